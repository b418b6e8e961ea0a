#!/usr/bin/env bash
# Troupe as a library (docs/embedding.md): `meson install --destdir` stages the shared library,
# the public headers (include/troupe only) and troupe.pc; examples/embedded_trainer, copied out
# of the tree, builds against the staged copy with `pkg-config troupe` (its own meson.build) and
# trains a tiny recipe through the embedding API, ending with the same final weights as
# `troupe train`.
# Usage: install.sh BUILD_DIR SOURCE_DIR TROUPE
set -euo pipefail
build=${1:?usage: install.sh BUILD_DIR SOURCE_DIR TROUPE}
src=${2:?usage: install.sh BUILD_DIR SOURCE_DIR TROUPE}
troupe=${3:?usage: install.sh BUILD_DIR SOURCE_DIR TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

stage="$tmp/stage"
timeout 300 meson install -C "$build" --destdir "$stage" --no-rebuild --quiet >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "meson install"; }
pc=$(find "$stage" -name troupe.pc | head -n 1)
[ -n "$pc" ] || fail "no troupe.pc installed"
lib=$(find "$stage" -name 'libtroupe.so.*' | head -n 1)
[ -n "$lib" ] || fail "no libtroupe.so installed"
header=$(find "$stage" -path '*/include/troupe/trainer.hpp' | head -n 1)
[ -n "$header" ] || fail "no include/troupe/trainer.hpp installed"
# Only the public headers: nothing of engine/, actors/, kernels/ or the generated wire code.
others=$(find "$stage" \( -name '*.hpp' -o -name '*.h' \) ! -path '*/include/troupe/*' | head -n 3)
[ -z "$others" ] || fail "internal headers installed: $others"
[ -x "$(find "$stage" -path '*/bin/troupe' | head -n 1)" ] || fail "no troupe command installed"

export PKG_CONFIG_PATH="$(dirname "$pc")" PKG_CONFIG_SYSROOT_DIR="$stage"
flags=$(pkg-config --cflags --libs troupe)
case " $flags " in *" -ltroupe "*) ;; *) fail "pkg-config --libs troupe: $flags" ;; esac

# The example as a user has it: its folder alone, built by its own meson.build.
cp -r "$src/examples/embedded_trainer" "$tmp/example"
(cd "$tmp" && timeout 400 meson setup example-build example >"$tmp/setup.log" 2>&1) ||
  { cat "$tmp/setup.log" >&2; fail "meson setup of the example"; }
timeout 400 ninja -C "$tmp/example-build" >"$tmp/ninja.log" 2>&1 ||
  { cat "$tmp/ninja.log" >&2; fail "building the example against the installed copy"; }
readelf -d "$tmp/example-build/embedded_trainer" | grep -q 'NEEDED.*libtroupe.so' ||
  fail "the example does not link libtroupe.so"

# shellcheck source=tests/cli/tiny_recipe.sh
source "$src/tests/cli/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/embedded" 6
LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  timeout 120 "$tmp/example-build/embedded_trainer" "$tmp/recipe.toml" >"$tmp/out" 2>"$tmp/err" ||
  { cat "$tmp/out" "$tmp/err" >&2; fail "the installed example failed"; }
[ "$(grep -c '^step [0-9]/6 loss ' "$tmp/out")" -eq 6 ] || { cat "$tmp/out" >&2; fail "not 6 step lines"; }
grep -q "^finished: 6 steps" "$tmp/out" || fail "not finished"
timeout 120 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/cli" >/dev/null 2>&1 ||
  fail "troupe train"
cmp "$tmp/embedded/final.safetensors" "$tmp/cli/final.safetensors" ||
  fail "final weights differ from troupe train"
echo "install: library, public headers and troupe.pc staged; the example built outside the tree against them trained as troupe train does"
