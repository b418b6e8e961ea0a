# Sourced by the tests that train a tiny model (cli_embedded_trainer, cli_examples,
# cli_trainer_service, tests/install): tiny_recipe DIR OUT_DIR STEPS [MICRO_BATCHES [SEED]]
# writes DIR/corpus.txt (200 lines of counting text) and DIR/recipe.toml: a 2-layer, width-16
# byte-level GPT trained on it for STEPS steps as a 2-stage pipeline of MICRO_BATCHES (default
# 2) micro-batches of 2 x 16 tokens, seed SEED (default 9), no validation, output in OUT_DIR.
tiny_recipe() {
  local dir=$1 out=$2 steps=$3 micro_batches=${4:-2} seed=${5:-9} i
  for i in $(seq 1 200); do echo "line $i: a small model learns to count to $((i * 7 % 13))."; done >"$dir/corpus.txt"
  cat >"$dir/recipe.toml" <<TOML
seed = $seed
steps = $steps
eval_interval = 0
[model]
vocab_size = 256
context = 16
layers = 2
heads = 2
width = 16
[data]
format = "text"
train = "$dir/corpus.txt"
[batch]
micro_batch = 2
seq_len = 16
[parallel]
pp = 2
micro_batches = $micro_batches
[output]
dir = "$out"
TOML
}
