#!/usr/bin/env bash
# Installs what is missing on a Debian 12 machine (Debian packages only) and builds Troupe into
# ${BUILD_DIR:-build}: everything, or with the argument `troupe` only the troupe command (what
# `troupe train` needs, not the tests). Safe to run again: it installs nothing that is already
# there and rebuilds only what changed. CUDA is built when nvcc exists (/usr/local/cuda), never
# required.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(g++ meson ninja-build pkg-config ccache clang-format libcaf-dev
          libopenblas-openmp-dev catch2 libcli11-dev libtomlplusplus-dev nlohmann-json3-dev
          libxxhash-dev fortunes python3-venv libucx-dev ucx-utils capnproto libcapnp-dev
          iproute2 libcpp-httplib-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

build="${BUILD_DIR:-build}"
set -f  # MESON_ARGS is split on spaces but never globbed: -Dcpp_args=['-a','-b'] stays one word
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" ${MESON_ARGS:-} >&2
elif [ -n "${MESON_ARGS:-}" ]; then
  meson configure "$build" ${MESON_ARGS} >&2
fi
# Meson does not give nvcc's objects their header dependencies here: when a header a CUDA
# source includes is newer than the last build, rebuild every CUDA object (ccache makes the
# unchanged ones cheap), or an object keeps an old layout of a class the others changed.
stamp="$build/.cuda-headers-built"
if [ -f "$stamp" ] && [ -n "$(find kernels engine -name '*.hpp' -newer "$stamp" -o -name '*.cuh' -newer "$stamp" | head -1)" ]; then
  find kernels/cuda -name "*.cu" -exec touch {} +  # (globbing is off: set -f above)
fi
targets=()
[ "${1:-}" = troupe ] && targets=(tools/troupe)
ninja -C "$build" "${targets[@]}" >&2
# The header stamp only after a whole build: a partial one leaves other CUDA objects unbuilt.
[ ${#targets[@]} -gt 0 ] || touch "$stamp"
