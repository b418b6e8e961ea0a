#!/usr/bin/env bash
# `troupe sample` end to end: a tiny byte-level model trained briefly by `troupe train`, then
# sampled from its final.safetensors (with --recipe, and with the shape inferred from the
# tensors), from a checkpoint step directory and a checkpoint root (the recipe read from
# trainer_state.json), and a model with a 300-token vocabulary through a hand-written BPE
# --tokenizer. Checks: stdout is the prompt, one byte per new token, a newline; the same seed
# gives the same text, another seed other text, greedy ignores the seed; bad input is one line
# naming the file or option, exit 2.
# Usage: cli_sample.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_sample.sh TROUPE}
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

words=(the quick brown fox jumps over lazy dog while a small model learns to count)
for i in $(seq 1 150); do
  echo "sentence $i: ${words[$((i % 15))]} ${words[$(((i * 7) % 15))]} ${words[$(((i * 3) % 15))]}."
done >"$tmp/corpus.txt"

# Width 64 with 2 heads (head size 32): a shape inferred from the tensors alone (head size 64)
# says 1 head.
cat >"$tmp/recipe.toml" <<TOML
seed = 7
steps = 8
eval_interval = 0

[model]
vocab_size = 256
context = 16
layers = 1
heads = 2
width = 64

[data]
format = "text"
train = "$tmp/corpus.txt"
val_fraction = 0.1

[batch]
micro_batch = 2
seq_len = 16

[optimizer]
warmup_steps = 2

[output]
dir = "$tmp/run"
TOML
"$troupe" train "$tmp/recipe.toml" >"$tmp/train.log" 2>&1 || {
  cat "$tmp/train.log" >&2
  fail "troupe train exited $?"
}
weights=$tmp/run/final.safetensors
[[ -s $weights ]] || fail "no $weights"

# sample NAME ARGS...: runs troupe sample, stdout to $tmp/NAME.out, stderr to $tmp/NAME.err.
sample() {
  local name=$1
  shift
  "$troupe" sample "$@" --threads 1 >"$tmp/$name.out" 2>"$tmp/$name.err" || {
    cat "$tmp/$name.err" >&2
    fail "troupe sample $* exited $?"
  }
}
# check_shape NAME PROMPT TOKENS: NAME.out is PROMPT, TOKENS bytes, a newline.
check_shape() {
  "$py" - "$tmp/$1.out" "$2" "$3" <<'PY'
import sys
out, prompt, n = open(sys.argv[1], "rb").read(), sys.argv[2].encode(), int(sys.argv[3])
assert out.startswith(prompt), f"{sys.argv[1]}: does not start with the prompt: {out[:80]!r}"
assert len(out) == len(prompt) + n + 1, f"{sys.argv[1]}: {len(out)} bytes, expected {len(prompt) + n + 1}"
assert out.endswith(b"\n"), f"{sys.argv[1]}: no final newline"
PY
}
same() { cmp -s "$tmp/$1.out" "$tmp/$2.out" || fail "$1 and $2 differ"; }
differ() { ! cmp -s "$tmp/$1.out" "$tmp/$2.out" || fail "$1 and $2 are the same"; }

prompt="sentence 12: the"
sample a "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 40 --seed 5
check_shape a "$prompt" 40
grep -q "40 tokens in" "$tmp/a.err" || fail "no summary line on stderr: $(cat "$tmp/a.err")"
sample a2 "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 40 --seed 5
same a a2
sample b "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 40 --seed 6
differ a b
sample topk "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 40 --top-k 3 \
  --temperature 0.7
check_shape topk "$prompt" 40
# Greedy: the seed does not matter.
sample g1 "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 30 --temperature 0 \
  --seed 1
sample g2 "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 30 --temperature 0 \
  --seed 2
same g1 g2
check_shape g1 "$prompt" 30
# A prompt longer than the context (16): the window is its last 16 tokens.
long="sentence 1: the quick brown fox jumps over the lazy dog."
sample long "$weights" --recipe "$tmp/recipe.toml" --prompt "$long" --tokens 20
check_shape long "$long" 20
sample none "$weights" --recipe "$tmp/recipe.toml" --prompt "$prompt" --tokens 0
check_shape none "$prompt" 0

# No recipe: the shape from the tensors, said on stderr.
sample inferred "$weights" --prompt "$prompt" --tokens 10
check_shape inferred "$prompt" 10
grep -q "no recipe: inferred from .*layers 1, width 64, vocabulary 256, context 16, heads 1" \
  "$tmp/inferred.err" || fail "inferred shape not said: $(cat "$tmp/inferred.err")"

# Checkpoints: a step directory, and a root whose newest committed step (with a manifest) is
# taken; step-00000009 has no manifest (torn) and is passed over.
ckpt=$tmp/ckpt
for step in 00000004 00000008 00000009; do
  mkdir -p "$ckpt/step-$step"
  cp "$weights" "$ckpt/step-$step/model.safetensors"
done
"$py" - "$tmp/recipe.toml" "$ckpt/step-00000008/trainer_state.json" <<'PY'
import json, sys
json.dump({"step": 8, "recipe": open(sys.argv[1]).read(), "overrides": []}, open(sys.argv[2], "w"))
PY
echo '{"magic": "troupe-checkpoint"}' >"$ckpt/step-00000004/manifest.json"
echo '{"magic": "troupe-checkpoint"}' >"$ckpt/step-00000008/manifest.json"
sample step "$ckpt/step-00000008" --prompt "$prompt" --tokens 40 --seed 5
same a step
grep -q "step-00000008/trainer_state.json (recipe)" "$tmp/step.err" ||
  fail "step: the recipe not read from trainer_state.json: $(cat "$tmp/step.err")"
sample root "$ckpt" --prompt "$prompt" --tokens 40 --seed 5
same a root
grep -q "checkpoint $ckpt/step-00000008" "$tmp/root.err" || fail "root: $(cat "$tmp/root.err")"

# A 300-token vocabulary: refused without --tokenizer, sampled with a BPE one. The weights are
# written here (all zero: every logit equal, so greedy picks id 0, "!").
bpe=$tmp/bpe
mkdir -p "$bpe"
"$py" - "$tmp/v300.safetensors" "$bpe" <<'PY'
import json, struct, sys
V, C, T = 300, 64, 16
shapes = {"wte.weight": [V, C], "wpe.weight": [T, C], "ln_f.weight": [C], "ln_f.bias": [C]}
for n, s in {"ln_1.weight": [C], "ln_1.bias": [C], "attn.c_attn.weight": [C, 3 * C],
             "attn.c_attn.bias": [3 * C], "attn.c_proj.weight": [C, C], "attn.c_proj.bias": [C],
             "ln_2.weight": [C], "ln_2.bias": [C], "mlp.c_fc.weight": [C, 4 * C],
             "mlp.c_fc.bias": [4 * C], "mlp.c_proj.weight": [4 * C, C], "mlp.c_proj.bias": [C]}.items():
    shapes["h.0." + n] = s
header, offset = {}, 0
for name, shape in shapes.items():
    n = 4
    for d in shape:
        n *= d
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
    offset += n
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + bytes(offset))
# GPT-2's byte symbols, then two merges.
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
sym = dict(zip(bs, map(chr, cs)))
vocab = {sym[b]: i for i, b in enumerate(bs)}  # id 0 is "!", as in GPT-2
vocab["\u0120t"], vocab["he"] = 256, 257
json.dump(vocab, open(sys.argv[2] + "/vocab.json", "w"))
open(sys.argv[2] + "/merges.txt", "w").write("#version: 0.2\n\u0120 t\nh e\n")
PY
sample bpe "$tmp/v300.safetensors" --tokenizer "$bpe" --prompt "the cat" --tokens 5 --temperature 0
[[ $(cat "$tmp/bpe.out") == "the cat!!!!!" ]] || fail "bpe: $(cat "$tmp/bpe.out")"

# Bad input: exit 2 and one line on stderr naming the file or option.
expect_bad() {
  local name=$1 pattern=$2
  shift 2
  local rc=0
  "$troupe" sample "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
  [[ $rc == 2 ]] || fail "$name: exit $rc, expected 2: $(cat "$tmp/$name.err")"
  [[ $(wc -l <"$tmp/$name.err") == 1 ]] || fail "$name: not one line: $(cat "$tmp/$name.err")"
  grep -q -- "$pattern" "$tmp/$name.err" || fail "$name: no '$pattern' in: $(cat "$tmp/$name.err")"
  [[ ! -s $tmp/$name.out ]] || fail "$name: wrote to stdout"
}
expect_bad missing "$tmp/nope.safetensors: no such file" "$tmp/nope.safetensors" --prompt x
expect_bad empty_dir "no model.safetensors and no step-\* directory" "$tmp/bpe" --prompt x
expect_bad temperature "\-\-temperature" "$weights" --prompt x --temperature -1
expect_bad top_k "\-\-top-k" "$weights" --prompt x --top-k -3
expect_bad tokens "\-\-tokens" "$weights" --prompt x --tokens lots
expect_bad prompt "\-\-prompt" "$weights" --prompt ""
# --device cuda: where no GPU can run it, exit 1 (as `troupe train`) with one line naming the
# option, nothing on stdout (cli_gpu_train samples on a GPU against the CPU).
rc=0
"$troupe" sample "$weights" --prompt x --tokens 1 --device cuda >"$tmp/cuda.out" 2>"$tmp/cuda.err" ||
  rc=$?
if [[ $rc -ne 0 ]]; then
  [[ $rc == 1 ]] || fail "cuda: exit $rc, expected 1: $(cat "$tmp/cuda.err")"
  [[ $(wc -l <"$tmp/cuda.err") == 1 ]] || fail "cuda: not one line: $(cat "$tmp/cuda.err")"
  grep -q -- "^troupe sample: error: --device cuda: " "$tmp/cuda.err" ||
    fail "cuda: does not say why: $(cat "$tmp/cuda.err")"
  [[ ! -s $tmp/cuda.out ]] || fail "cuda: wrote to stdout"
fi
sed 's/width = 64/width = 32/' "$tmp/recipe.toml" >"$tmp/narrow.toml"
expect_bad shapes "final.safetensors: tensor transformer.wte.weight has shape \[256, 64\], expected \[256, 32\]" \
  "$weights" --prompt x --recipe "$tmp/narrow.toml"
expect_bad recipe "$tmp/absent.toml" "$weights" --prompt x --recipe "$tmp/absent.toml"
expect_bad vocab "pass --tokenizer" "$tmp/v300.safetensors" --prompt x
expect_bad tokenizer "\-\-tokenizer: .*vocab.json: cannot read" "$tmp/v300.safetensors" --prompt x \
  --tokenizer "$tmp/run"
printf 'not a safetensors file' >"$tmp/junk.safetensors"
expect_bad junk "junk.safetensors" "$tmp/junk.safetensors" --prompt x

echo "cli_sample: ok"
