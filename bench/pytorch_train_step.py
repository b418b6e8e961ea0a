#!/usr/bin/env python3
"""PyTorch peer benchmark: GPT-2 training steps, on the CPU in fp32 or on a GPU.

    python pytorch_train_step.py --layers 4 --heads 4 --width 256 --vocab 256 --context 128 \
        --batch 8 --seq 128 --steps 20 --warmup 3 --threads 8
    python pytorch_train_step.py --device cuda --dtype bf16 [--compile] --layers 12 --heads 12 \
        --width 768 --vocab 50257 --context 1024 --batch 16 --seq 1024 --steps 20 --warmup 5

Each step is forward + cross-entropy + backward + AdamW step + zero_grad on random tokens
(dropout 0, tied embeddings). CPU: eager attention. CUDA: what a PyTorch user runs for speed,
fp32 master weights with bf16 autocast (--dtype bf16), SDPA (flash) attention, fused AdamW, and
with --compile the model under torch.compile. Prints one JSON line on stdout:
{"tokens_per_s", "step_ms_median", "params", "torch", "blas", "threads", "peak_device_bytes",
...}; tokens_per_s is the
median over timed steps of batch * seq / step time. Run it with the oracle venv's python
(tests/oracle/venv.sh prints it).
"""

import argparse
import json
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def blas_info():
    try:
        cfg = torch.__config__.show()
    except Exception:  # pragma: no cover - very old or stripped builds
        return "unknown"
    m = re.search(r"BLAS_INFO=([^,\s]+)", cfg)
    if m:
        return m.group(1)
    low = cfg.lower()
    for name in ("mkl", "openblas", "accelerate", "blis", "eigen"):
        if name in low:
            return name
    return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.seq > args.context:
        ap.error("--seq must be <= --context")
    if args.width % args.heads:
        ap.error("--width must be a multiple of --heads")
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa" if cuda else "eager"
    model = GPT2LMHeadModel(config).float().to(args.device)
    model.train()
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {}))
    forward = torch.compile(model) if args.compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.dtype == "bf16")

    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
               for _ in range(4)]

    def step(i):
        block = batches[i % len(batches)]
        x, y = block[:, :-1], block[:, 1:]
        with autocast:
            logits = forward(x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # forces completion of the step

    for i in range(args.warmup):
        step(i)
    times, loss = [], float("nan")
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss = step(args.warmup + i)
        times.append(time.perf_counter() - t0)

    median = statistics.median(times)
    print(json.dumps({
        "tokens_per_s": statistics.median(args.batch * args.seq / t for t in times),
        "step_ms_median": median * 1e3,
        "step_ms_min": min(times) * 1e3,
        "params": n_params,
        "torch": torch.__version__,
        "blas": blas_info(),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": args.dtype,
        "compile": args.compile,
        "last_loss": loss,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
