#!/usr/bin/env bash
# Create (or reuse) the Python virtual environment for the reference tools and print its python.
#
#   PY=$(tests/oracle/venv.sh) || { [ $? -eq 77 ] && echo SKIP; }
#
# The venv lives at ${TROUPE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/troupe/venv-<sha256(requirements)[:12]>}
# so a change to requirements.txt gets a fresh one. Stdout carries only the python path; progress goes
# to stderr. Exit 77 (SKIP for callers) when the venv cannot be created or the packages cannot be
# installed (for example without network access).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements.txt"
[ -f "$req" ] || { echo "venv.sh: missing $req" >&2; exit 77; }

hash="$(sha256sum "$req" | cut -c1-12)"
venv="${TROUPE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/troupe/venv-$hash}"
python="${PYTHON:-/usr/bin/python3}"

skip() { echo "venv.sh: $*" >&2; exit 77; }

mkdir -p "$(dirname "$venv")" || skip "cannot create $(dirname "$venv")"

# Serialise concurrent builders on a lock file next to the venv.
lock="$venv.lock"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$lock" || skip "cannot open lock $lock"
    flock 9 || skip "cannot lock $lock"
fi

if [ -f "$venv/.complete" ] && [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
    exit 0
fi

# A venv without the marker is half-built: start again.
if [ -e "$venv" ]; then
    echo "venv.sh: removing incomplete venv $venv" >&2
    rm -rf "$venv"
fi

echo "venv.sh: creating $venv with $python" >&2
if ! "$python" -m venv "$venv" >&2; then
    rm -rf "$venv"
    skip "cannot create venv with $python -m venv"
fi

echo "venv.sh: installing $(tr '\n' ' ' <"$req")" >&2
if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2; then
    rm -rf "$venv"
    skip "cannot install $req (no network?)"
fi

touch "$venv/.complete"
echo "venv.sh: ready" >&2
echo "$venv/bin/python"
