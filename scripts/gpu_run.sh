#!/usr/bin/env bash
# The GPU checks (docs/gpu.md) as one command on a machine with an NVIDIA GPU whose image lacks
# the Debian packages Troupe links (CAF, UCX, Cap'n Proto, OpenBLAS, Catch2, ...).
#
#   scripts/gpu_run.sh fetch   on a Debian 12 machine: downloads those packages (apt-get
#                              download, no install) into .gpu-debs/ (git-ignored)
#   scripts/gpu_run.sh run     on the GPU machine, with .gpu-debs/ beside the checkout: unpacks
#                              them under /tmp/troupe-deps (never into /), builds with CUDA into
#                              build-gpu, runs the `gpu` suite and then
#                              `troupe bench train-step --device cuda` (GPT-2 small, bf16, next
#                              to PyTorch eager and torch.compile). Logs and the bench's JSON go
#                              to $OUT when it is set, else to build-gpu/.
#
# The GPU machine needs g++, nvcc (/usr/local/cuda), meson, ninja and dpkg-deb; python3 with
# torch for the peer. BENCH_ARGS adds options to the bench (e.g. "--batch 8 --steps 10").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

debs=.gpu-debs
packages=(libcaf-dev libcaf-core0.17 libcaf-io0.17 libcaf-openssl0.17 libucx-dev libucx0 libnuma1
          libibverbs1 librdmacm1 libcapnp-dev libcapnp-0.9.2 capnproto libopenblas-openmp-dev
          libopenblas0-openmp libopenblas-dev libopenblas0 libgfortran5 catch2 libcli11-dev
          libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev libxxhash-dev libxxhash0 pkgconf
          pkgconf-bin libpkgconf3 libssl-dev)

fetch() {
  mkdir -p "$debs"
  (cd "$debs" && rm -f ./*.deb && apt-get download "${packages[@]}")
  echo "gpu_run: $(ls "$debs"/*.deb | wc -l) packages, $(du -sh "$debs" | cut -f1) in $debs" >&2
}

run() {
  ls "$debs"/*.deb >/dev/null 2>&1 || { echo "gpu_run: no packages in $debs (run 'fetch' first)" >&2; exit 2; }
  local out="${OUT:-build-gpu}" root=/tmp/troupe-deps
  mkdir -p "$out"
  rm -rf "$root"
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$root"; done
  local lib="$root/usr/lib/x86_64-linux-gnu"
  local blas="$lib/openblas-openmp"
  # pkg-config answers only from the unpacked packages, with their /usr paths moved under $root.
  export PKG_CONFIG="$root/usr/bin/pkgconf"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$blas/pkgconfig:$root/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$root"
  export CPATH="$root/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$lib:$blas${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export PATH="$root/usr/bin:/usr/local/cuda/bin:$PATH"
  local build_env=(env "LD_LIBRARY_PATH=$lib:$blas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  {
    echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    nvcc --version | tail -1; g++ --version | head -1; meson --version
  } 2>&1 | tee "$out/machine.txt"
  # The image's compiler may warn where Debian's g++ 12 does not: no -Werror there. The binaries
  # find the unpacked libraries (and theirs) by DT_RPATH, so nothing else (the Python peer) sees
  # them; targets with CUDA objects are linked by nvcc, hence cuda_link_args too.
  [ -f build-gpu/build.ninja ] ||
    "${build_env[@]}" meson setup build-gpu -Dwith_cuda=enabled -Dbuildtype=release \
      -Dwerror=false "-Dcpp_link_args=-Wl,--disable-new-dtags,-rpath,$lib:$blas" \
      "-Dcuda_link_args=-Xlinker=--disable-new-dtags -Xlinker=-rpath=$lib:$blas" 2>&1 |
      tee "$out/setup.log"
  "${build_env[@]}" ninja -C build-gpu tests/kernels/test_cuda_ops tests/kernels/test_nccl_group \
    tests/engine/test_gpu_trainer tools/troupe 2>&1 | tail -5 | tee "$out/build.log"
  set +e
  meson test -C build-gpu --suite gpu --no-rebuild --print-errorlogs 2>&1 | tee "$out/gpu_suite.log"
  local suite=${PIPESTATUS[0]}
  cp build-gpu/meson-logs/testlog.txt "$out/gpu_testlog.txt" 2>/dev/null
  # shellcheck disable=SC2086
  ./build-gpu/tools/troupe bench train-step --device cuda --json ${BENCH_ARGS:-} \
    >"$out/bench_train_step.json" 2>"$out/bench_train_step.err"
  local bench=$?
  set -e
  echo "gpu_run: gpu suite exit $suite, bench exit $bench"
  [ "$bench" -eq 0 ] || cat "$out/bench_train_step.err"
  [ "$bench" -ne 0 ] || python3 - "$out/bench_train_step.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
t = r["troupe"]
print(f"troupe {t['tokens_per_s']:.0f} tok/s, {t['step_ms_median']:.1f} ms/step, MFU {100*t['mfu']:.1f}%")
for p in r.get("peers", []):
    if "tokens_per_s" in p:
        print(f"{p['name']}: {p['tokens_per_s']:.0f} tok/s, MFU {100*p['mfu']:.1f}%, troupe/peer {p['ratio']:.2f}x")
    else:
        print(f"{p['name']}: {p['error']}")
PY
  [ "$suite" -eq 0 ] && [ "$bench" -eq 0 ]
}

case "${1:-}" in
  fetch) fetch ;;
  run) run ;;
  *) echo "usage: scripts/gpu_run.sh fetch|run" >&2; exit 2 ;;
esac
