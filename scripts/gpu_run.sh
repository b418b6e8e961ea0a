# The benchmark's JSON as lines: per batch size, each Troupe run's tokens/s and MFU, each peer's
# and the best Troupe run's ratio to it.
bench_summary() {
  python3 - "$1" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for run in r["runs"]:
    for t in run["troupe"]:
        if "error" in t:
            print(f"B={run['batch']} troupe ({t['attention']}): {t['error']}")
            continue
        print(f"B={run['batch']} troupe ({t['attention']}): {t['tokens_per_s']:.0f} tok/s, "
              f"{t['step_ms_median']:.1f} ms/step, MFU {100*t['mfu']:.1f}%, "
              f"{t['device_bytes']/2**30:.1f} GiB")
    for p in run.get("peers", []):
        if "tokens_per_s" in p:
            print(f"B={run['batch']} {p['name']}: {p['tokens_per_s']:.0f} tok/s, MFU {100*p['mfu']:.1f}%, "
                  f"peak {p['result'].get('peak_device_bytes', 0)/2**30:.1f} GiB, "
                  f"best troupe/peer {p.get('ratio', 0):.2f}x")
        else:
            print(f"B={run['batch']} {p['name']}: {p['error']}")
PY
}

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
#   scripts/gpu_run.sh pack    here, after a CUDA build in build/ (release): copies the troupe
#                              binary and the `gpu` suite's test programs into .gpu-bin/
#                              (git-ignored), so the GPU machine need not build.
#   scripts/gpu_run.sh prebuilt  on the GPU machine, with .gpu-debs/ and .gpu-bin/: the `run`
#                              checks with those programs, found by LD_LIBRARY_PATH (the unpacked
#                              packages, the CUDA runtime and NCCL); TRANSPORT=1 adds
#                              `troupe bench transport` (ucx_perftest from ucx-utils), PROFILE=1
#                              a per-kernel summary of one training step by Nsight Compute.
#
# The GPU machine needs g++, nvcc (/usr/local/cuda), meson, ninja and dpkg-deb; python3 with
# torch for the peer. BENCH_ARGS replaces the bench's options (prebuilt's default: "--batch 16,64
# --breakdown": the default kernels at B = 16 and 64, the time per op family, the peers). TESTS
# names the test programs to run (default all three), CLI=0 leaves out cli_gpu_train, BENCH=0 the
# train-step bench; CHECKPOINT=1 adds `troupe bench checkpoint --device cuda` in both formats,
# first. TEST_TIMEOUT, CLI_TIMEOUT and CHECKPOINT_TIMEOUT bound each part (seconds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

debs=.gpu-debs
packages=(libcaf-dev libcaf-core0.17 libcaf-io0.17 libcaf-openssl0.17 libucx-dev libucx0 libnuma1
          libibverbs1 librdmacm1 libcapnp-dev libcapnp-0.9.2 capnproto libopenblas-openmp-dev
          libopenblas0-openmp libopenblas-dev libopenblas0 libgfortran5 catch2 libcli11-dev
          libtomlplusplus-dev libtomlplusplus3 nlohmann-json3-dev libxxhash-dev libxxhash0 pkgconf
          pkgconf-bin libpkgconf3 libssl-dev ucx-utils)

fetch() {
  mkdir -p "$debs"
  (cd "$debs" && rm -f ./*.deb && apt-get download "${packages[@]}")
  echo "gpu_run: $(ls "$debs"/*.deb | wc -l) packages, $(du -sh "$debs" | cut -f1) in $debs" >&2
}

bins=.gpu-bin
root=/tmp/troupe-deps
lib="$root/usr/lib/x86_64-linux-gnu"
blas="$lib/openblas-openmp"

unpack() {
  ls "$debs"/*.deb >/dev/null 2>&1 || { echo "gpu_run: no packages in $debs (run 'fetch' first)" >&2; exit 2; }
  rm -rf "$root"
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$root"; done
}

# What the machine is (each line may be missing: no failure).
machine() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  { nvcc --version | tail -1; } || true
  { g++ --version | head -1; } || true
  nproc
}

pack() {
  local programs=(tools/troupe tests/kernels/test_cuda_ops tests/kernels/test_nccl_group
                  tests/engine/test_gpu_trainer)
  for p in "${programs[@]}"; do
    [ -x "build/$p" ] || { echo "gpu_run: build/$p missing (a CUDA build in build/ first)" >&2; exit 2; }
  done
  rm -rf "$bins" && mkdir -p "$bins"
  for p in "${programs[@]}"; do cp "build/$p" "$bins/"; done
  echo "gpu_run: $(du -sh "$bins" | cut -f1) in $bins" >&2
}

prebuilt() {
  [ -x "$bins/troupe" ] || { echo "gpu_run: no programs in $bins (run 'pack' here first)" >&2; exit 2; }
  unpack
  local out="${OUT:-$bins/out}" cuda nccl
  mkdir -p "$out"
  cuda=$(dirname "$(find /usr/local/cuda/lib64/ -name "libcudart.so.*" | head -1)")
  nccl=$(dirname "$(find /usr/local/cuda/ /usr/lib /opt -name 'libnccl.so.2*' 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH="$lib:$blas:$cuda:$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export UCX_MODULE_DIR="$lib/ucx" PATH="$root/usr/bin:$PATH"
  export TROUPE_SOURCE_DIR="$PWD"  # the bench's PyTorch peer script
  machine 2>&1 | tee "$out/machine.txt"
  local failed=0 t
  # What a checkpoint costs on the GPU (docs/checkpoints.md), in each format; and what the
  # machine's disk writes and syncs, the bound of a checkpoint's write.
  if [ "${CHECKPOINT:-0}" = 1 ]; then
    cat docs/*.md >/tmp/troupe-corpus.txt
    dd if=/dev/zero of=/tmp/troupe-dd bs=16M count=64 conv=fdatasync 2>&1 | tail -n 1 |
      sed 's/^/gpu_run: disk: 1 GiB written and synced: /'
    rm -f /tmp/troupe-dd
    local format
    for format in whole parts; do
      sed "s/^\[output\]/[checkpoint]\nformat = \"$format\"\n\n[output]/" examples/default.toml \
        >"/tmp/troupe-ckpt-$format.toml"
      timeout -k 5 "${CHECKPOINT_TIMEOUT:-200}" "$bins/troupe" bench checkpoint --device cuda \
        --recipe "/tmp/troupe-ckpt-$format.toml" --data /tmp/troupe-corpus.txt \
        >"$out/bench_checkpoint_$format.txt" 2>&1 || failed=1
      echo "gpu_run: bench checkpoint ($format):"
      cat "$out/bench_checkpoint_$format.txt"
    done
  fi
  # shellcheck disable=SC2086
  for t in ${TESTS:-test_cuda_ops test_nccl_group test_gpu_trainer}; do
    timeout -k 5 "${TEST_TIMEOUT:-300}" "$bins/$t" --durations yes >"$out/$t.log" 2>&1 || failed=1
    echo "gpu_run: $t: $(tail -n 2 "$out/$t.log" | head -n 1)"
  done
  if [ "${CLI:-1}" = 1 ]; then
    timeout -k 5 "${CLI_TIMEOUT:-600}" bash tests/cli/cli_gpu_train.sh "$bins/troupe" \
      >"$out/cli_gpu_train.log" 2>&1 || failed=1
    echo "gpu_run: cli_gpu_train: $(tail -n 1 "$out/cli_gpu_train.log")"
  fi
  # shellcheck disable=SC2086
  if [ "${BENCH:-1}" = 0 ]; then
    :
  elif timeout -k 5 600 "$bins/troupe" bench train-step --device cuda --json \
    ${BENCH_ARGS:---batch 16,64 --breakdown} \
    >"$out/bench_train_step.json" 2>"$out/bench_train_step.err"; then
    bench_summary "$out/bench_train_step.json"
  else
    failed=1; cat "$out/bench_train_step.err"
  fi
  # Where the step's time goes, per kernel (Nsight Compute; one short step, no peer).
  if [ "${PROFILE:-0}" = 1 ]; then
    local ncu
    ncu=$(command -v ncu || find /usr/local/cuda/bin /opt/nvidia -name ncu -type f 2>/dev/null |
      head -1 || true)
    [ -n "$ncu" ] || ncu=ncu
    timeout -k 5 600 "$ncu" --clock-control none --metrics gpu__time_duration.sum \
      --print-summary per-kernel "$bins/troupe" bench train-step --device cuda --no-peer \
      --steps 1 --warmup 1 >"$out/profile.txt" 2>&1 || failed=1
    echo "gpu_run: per-kernel times in $out/profile.txt"
  fi
  if [ "${TRANSPORT:-0}" = 1 ]; then
    timeout -k 5 600 "$bins/troupe" bench transport | tee "$out/bench_transport.txt" || failed=1
  fi
  return "$failed"
}

run() {
  unpack
  local out="${OUT:-build-gpu}"
  mkdir -p "$out"
  # pkg-config answers only from the unpacked packages, with their /usr paths moved under $root.
  export PKG_CONFIG="$root/usr/bin/pkgconf"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$blas/pkgconfig:$root/usr/share/pkgconfig"
  export PKG_CONFIG_SYSROOT_DIR="$root"
  export CPATH="$root/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$lib:$blas${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export PATH="$root/usr/bin:/usr/local/cuda/bin:$PATH"
  local build_env=(env "LD_LIBRARY_PATH=$lib:$blas${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  { machine; meson --version; } 2>&1 | tee "$out/machine.txt"
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
  ./build-gpu/tools/troupe bench train-step --device cuda --json \
    ${BENCH_ARGS:---batch 16,64 --breakdown} \
    >"$out/bench_train_step.json" 2>"$out/bench_train_step.err"
  local bench=$?
  set -e
  echo "gpu_run: gpu suite exit $suite, bench exit $bench"
  [ "$bench" -eq 0 ] || cat "$out/bench_train_step.err"
  [ "$bench" -ne 0 ] || bench_summary "$out/bench_train_step.json"
  [ "$suite" -eq 0 ] && [ "$bench" -eq 0 ]
}

case "${1:-}" in
  fetch) fetch ;;
  run) run ;;
  pack) pack ;;
  prebuilt) prebuilt ;;
  *) echo "usage: scripts/gpu_run.sh fetch|run|pack|prebuilt" >&2; exit 2 ;;
esac
