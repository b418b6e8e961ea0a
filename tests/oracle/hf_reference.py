#!/usr/bin/env python3
"""Hugging Face GPT-2 reference for Troupe.

    python hf_reference.py --out DIR [--steps 10]

Writes into DIR:
  hf/                     the model as save_pretrained wrote it (config.json, model.safetensors)
  model.safetensors       a copy of hf/model.safetensors (the file `troupe` imports)
  reference.safetensors   one batch: inputs, targets, logits, loss and grad.<name> per parameter
  tokens.bin              an llm.c token shard (4096 random tokens in [0, 250))
  recipe.toml             the recipe `troupe train` runs to reproduce expected.json
  expected.json           {"losses", "grad_norms", "lrs"} of the PyTorch training run
  expected_final.safetensors  the weights after the PyTorch training run (same names as model.safetensors)

Everything is fp32 on the CPU, eager attention, seeded with 1234. The training run follows
docs/recipe.md: sequential batches, mean cross-entropy per micro-batch, gradients scaled by
1/grad_accum, global-norm clipping, AdamW with weight decay on tensors with dim >= 2 only.
"""

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

SEED = 1234
VOCAB = 250
PADDED_VOCAB = 256
CONTEXT = 32
LAYERS = 2
HEADS = 4
WIDTH = 48

# The one-batch reference.
REF_B, REF_T, REF_IGNORED = 4, 16, 5

# The training run.
NTOKENS = 4096
B, T, GRAD_ACCUM = 4, 16, 2
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 3, "cosine"
BETA1, BETA2, EPS, WEIGHT_DECAY, GRAD_CLIP = 0.9, 0.95, 1e-8, 0.1, 0.5

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def make_config():
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,  # the GPT-2 default (50256) lies outside this vocabulary
        eos_token_id=None,
    )
    config._attn_implementation = "eager"
    return config


def saved_tensor_names(path):
    with safe_open(path, framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def param_file_names(model, saved):
    """Map each named parameter to its name in the saved file (keeping or adding the prefix)."""
    names = {}
    for name, _ in model.named_parameters():
        candidates = [name, name.removeprefix("transformer."), "transformer." + name]
        hit = [c for c in candidates if c in saved]
        if not hit:
            raise SystemExit(f"hf_reference: parameter {name} has no tensor in the saved file")
        names[name] = hit[0]
    return names


def lr_at(step, steps):
    """docs/recipe.md learning-rate schedule, step counted from 0."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    if DECAY == "constant":
        return LR
    ratio = (step - WARMUP) / max(1, steps - WARMUP)
    if DECAY == "cosine":
        return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)
    if DECAY == "linear":
        return LR + ratio * (MIN_LR - LR)
    raise ValueError(DECAY)


def write_shard(path, tokens):
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def read_shard(path):
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    assert header[0] == SHARD_MAGIC and header[1] == SHARD_VERSION, "bad shard header"
    tokens = np.fromfile(path, dtype="<u2", offset=SHARD_HEADER_INTS * 4)
    assert len(tokens) == header[2], "shard length does not match its header"
    return tokens


def micro_batch(tokens, i):
    """Rows of micro-batch i in sequential order (docs/recipe.md)."""
    n_batches = (len(tokens) - 1) // (B * T)
    i %= n_batches
    rows = [tokens[(i * B + r) * T:(i * B + r) * T + T + 1] for r in range(B)]
    block = torch.from_numpy(np.stack(rows).astype(np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def toml_str(s):
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def write_recipe(path, init, train, run_dir, steps):
    text = f"""# Written by tests/oracle/hf_reference.py: `troupe train` on this recipe must reproduce expected.json.
seed = {SEED}
steps = {steps}
eval_interval = 0
init = {toml_str(init)}

[model]
vocab_size = {VOCAB}
padded_vocab_size = {PADDED_VOCAB}
context = {CONTEXT}
layers = {LAYERS}
heads = {HEADS}
width = {WIDTH}

[data]
format = "shards"
train = {toml_str(train)}
val = {toml_str(train)}
val_fraction = 0.0
order = "sequential"

[batch]
micro_batch = {B}
seq_len = {T}
grad_accum = {GRAD_ACCUM}

[optimizer]
lr = {LR!r}
min_lr = {MIN_LR!r}
warmup_steps = {WARMUP}
decay = "{DECAY}"
beta1 = {BETA1!r}
beta2 = {BETA2!r}
eps = {EPS!r}
weight_decay = {WEIGHT_DECAY!r}
grad_clip = {GRAD_CLIP!r}

[output]
dir = {toml_str(run_dir)}
metrics = "metrics.jsonl"
weights = "final.safetensors"
"""
    with open(path, "w") as f:
        f.write(text)


def reference_batch(model, out, file_names):
    gen = torch.Generator().manual_seed(SEED + 1)
    inputs = torch.randint(0, VOCAB, (REF_B, REF_T), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, VOCAB, (REF_B, REF_T), generator=gen, dtype=torch.int32)
    ignored = torch.randperm(REF_B * REF_T, generator=gen)[:REF_IGNORED]
    targets.view(-1)[ignored] = -100

    model.zero_grad(set_to_none=True)
    logits = model(inputs.long()).logits
    assert logits.shape == (REF_B, REF_T, VOCAB), logits.shape
    loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1).long(), ignore_index=-100)
    loss.backward()

    tensors = {
        "inputs": inputs.contiguous(),
        "targets": targets.contiguous(),
        "logits": logits.detach().float().contiguous(),
        "loss": loss.detach().float().reshape(1).contiguous(),
    }
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        tensors["grad." + file_names[name]] = p.grad.detach().float().contiguous().clone()
    save_file(tensors, os.path.join(out, "reference.safetensors"), metadata={"format": "pt"})
    log(f"reference batch: loss {loss.item():.7f}, {len(tensors) - 4} gradients")
    model.zero_grad(set_to_none=True)


def train(out, steps, file_names):
    model = GPT2LMHeadModel.from_pretrained(
        os.path.join(out, "hf"), attn_implementation="eager", dtype=torch.float32)
    model.eval()  # dropout is 0 anyway
    assert model.lm_head.weight is model.transformer.wte.weight, "embeddings are not tied"

    # The reloaded weights must be exactly the saved ones.
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), f.get_tensor(file_names[name])), f"reload differs: {name}"

    tokens = read_shard(os.path.join(out, "tokens.bin"))
    params = list(model.parameters())  # tied wte/lm_head appears once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(BETA1, BETA2), eps=EPS, foreach=False, fused=False)

    losses, grad_norms, lrs = [], [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for a in range(GRAD_ACCUM):
            x, y = micro_batch(tokens, s * GRAD_ACCUM + a)
            logits = model(x).logits
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
            (loss / GRAD_ACCUM).backward()
            step_loss += loss.item()
        step_loss /= GRAD_ACCUM
        norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP) if GRAD_CLIP > 0 else \
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        lr = lr_at(s, steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(step_loss)
        grad_norms.append(float(norm))
        lrs.append(lr)
        print(f"step {s:3d}  loss {step_loss:.7f}  grad_norm {float(norm):.6f}  lr {lr:.6e}", flush=True)

    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"losses": losses, "grad_norms": grad_norms, "lrs": lrs}, f, indent=1)
        f.write("\n")
    final = {file_names[n]: p.detach().float().contiguous().clone() for n, p in model.named_parameters()}
    save_file(final, os.path.join(out, "expected_final.safetensors"), metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)

    model = GPT2LMHeadModel(make_config())
    model.eval()
    log(f"torch {torch.__version__}, attention {model.config._attn_implementation}, "
        f"tied {model.lm_head.weight is model.transformer.wte.weight}")

    hf_dir = os.path.join(out, "hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    model_file = os.path.join(out, "model.safetensors")
    shutil.copyfile(os.path.join(hf_dir, "model.safetensors"), model_file)

    saved = saved_tensor_names(model_file)
    log(f"{model_file}: {len(saved)} tensors")
    for name, shape in saved.items():
        log(f"  {name:40s} {list(shape)}")
    log(f"  lm_head.weight present: {'lm_head.weight' in saved}")
    file_names = param_file_names(model, saved)
    for name, p in model.named_parameters():
        assert tuple(p.shape) == saved[file_names[name]], f"shape differs: {name}"
    unused = set(saved) - set(file_names.values())
    if unused:
        log(f"  tensors that are not parameters: {sorted(unused)}")

    reference_batch(model, out, file_names)

    gen = np.random.default_rng(SEED)
    write_shard(os.path.join(out, "tokens.bin"), gen.integers(0, VOCAB, NTOKENS, dtype=np.uint16))
    write_recipe(os.path.join(out, "recipe.toml"), model_file, os.path.join(out, "tokens.bin"),
                 os.path.join(out, "run"), args.steps)

    del model
    train(out, args.steps, file_names)


if __name__ == "__main__":
    main()
