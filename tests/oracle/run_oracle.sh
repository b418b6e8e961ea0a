#!/usr/bin/env bash
# The Hugging Face oracle, end to end (a meson test):
#   1. build/reuse the reference venv (exit 77 = SKIP when it cannot be built, e.g. offline);
#   2. hf_reference.py: a random GPT2LMHeadModel saved as safetensors, one batch's logits, loss
#      and gradients, and 10 AdamW steps on a token shard in sequential order;
#   3. check_hf_reference: Troupe's logits, loss and every gradient against HF (<= 1e-4);
#   4. `troupe train` on the recipe hf_reference.py wrote (init = the HF file), then its per-step
#      losses (rtol 1e-4), lrs and grad norms, and its final weights, against PyTorch's.
# Usage: run_oracle.sh CHECK_BINARY TROUPE_BINARY
set -euo pipefail
check_bin="$1"
troupe_bin="$2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

py="$(bash "$here/venv.sh")" || exit $?
work="$(mktemp -d "${TMPDIR:-/tmp}/troupe-oracle.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "== Hugging Face reference (torch, transformers) =="
"$py" "$here/hf_reference.py" --out "$work" --steps 10
echo "== logits, loss and gradients: Troupe vs Hugging Face =="
"$check_bin" "$work"
echo "== troupe train from the HF weights, sequential token shard, 10 AdamW steps =="
"$troupe_bin" train "$work/recipe.toml"
echo "== per-step losses vs PyTorch =="
"$py" "$here/compare_losses.py" "$work/expected.json" "$work/run/metrics.jsonl" --rtol 1e-4
echo "== final weights vs PyTorch =="
"$py" "$here/compare_weights.py" "$work/expected_final.safetensors" "$work/run/final.safetensors" \
    --init "$work/model.safetensors"
echo "oracle: PASS"
