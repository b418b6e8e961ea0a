#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang into ${BUILD_DIR:-build-fuzz} -- AddressSanitizer
# (clang 14 cannot build UBSan with OpenMP and coverage together; the GCC sanitizer pass has UBSan)
# and coverage instrumentation of the libraries under test -- and runs
# each for FUZZ_SECONDS (default 30) from a seed corpus of valid files and frames, keeping what it
# finds in the build directory's corpus-* folders between runs. A crash, a sanitizer report or a
# leak fails (exit 1) with libFuzzer's report and the input saved as crash-*; the last line is
# "fuzz: TARGET: N runs in S s, 0 crashes" per target.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=${FUZZ_SECONDS:-30}
build=${BUILD_DIR:-build-fuzz}
missing=()
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "fuzz: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
if [ ! -f "$build/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$build" -Dfuzz=enabled -Dwith_cuda=disabled -Dwerror=false \
    -Db_sanitize=address -Db_lundef=false -Doptimization=1 -Ddebug=false \
    "-Dcpp_args=['-g1','-fsanitize=fuzzer-no-link']" >&2
fi
ninja -C "$build" fuzz/fuzz_checkpoint fuzz/fuzz_wire >&2
export ASAN_OPTIONS="detect_leaks=1"
status=0
for t in checkpoint wire; do
  exe="$build/fuzz/fuzz_$t"
  seeds="$build/seeds-$t" corpus="$build/corpus-$t"
  mkdir -p "$seeds" "$corpus"
  FUZZ_WRITE_SEEDS="$seeds" "$exe"
  log="$build/fuzz-$t.log"
  if (cd "$build" && "../$exe" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=20 \
        -print_final_stats=1 "corpus-$t" "seeds-$t") >"$log" 2>&1; then
    runs=$(awk '/stat::number_of_executed_units:/ {print $2}' "$log")
    echo "fuzz: $t: ${runs:-?} runs in $seconds s, 0 crashes"
  else
    tail -n 60 "$log"
    echo "fuzz: $t: FAILED (input saved in $build as crash-* or leak-*)"
    status=1
  fi
done
exit "$status"
