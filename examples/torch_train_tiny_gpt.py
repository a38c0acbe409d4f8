#!/usr/bin/env python
"""Train a tiny GPT for a few steps on the CPU with ``numba_flash.torch.flash_attn_func`` as its
attention, beside the same model (same initial weights, same batches) on torch's
``scaled_dot_product_attention``, and print both losses step by step.

The task is a toy one that attention can learn: each sequence is a random walk of tokens, each
next token the previous one plus a per-sequence step (mod the vocabulary), so predicting it
needs the earlier tokens.  On a machine without a GPU numba_flash runs in the Numba CUDA
simulator (each CUDA thread a Python thread): the defaults take well under a minute.

    python examples/torch_train_tiny_gpt.py                 # 15 steps, 1 layer (37 s *)
    python examples/torch_train_tiny_gpt.py --steps 40 --layers 2 --batch 4   # a few minutes

(*) measured on a 2-core CPU machine shared with other work (load 20), imports included; the
numba_flash run is most of it.

Exits with status 1 if the two runs' losses ever differ by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from numba_flash.torch import flash_attn_func


class Block(torch.nn.Module):
    def __init__(self, d_model, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, n, c = x.shape
        # [docs:torch-flash-attn-func]
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        if self.attention == "numba_flash":  # flash-attn's layout: [batch, seqlen, heads, d]
            y = flash_attn_func(q, k, v, causal=True)
        else:  # torch SDPA takes [batch, heads, seqlen, d]
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True).transpose(1, 2)
        # [/docs:torch-flash-attn-func]
        x = x + self.proj(y.reshape(b, n, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab, seq_len, d_model, heads, layers, attention):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = torch.nn.ModuleList(Block(d_model, heads, attention)
                                          for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(steps, batch, seq_len, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        step = torch.randint(1, 4, (batch, 1), generator=g)
        yield (start + step * torch.arange(seq_len + 1)) % vocab


def train(attention, args):
    torch.manual_seed(args.seed)  # the same initial weights for both runs
    model = TinyGPT(args.vocab, args.seq_len, args.d_model, args.heads, args.layers, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for seqs in batches(args.steps, args.batch, args.seq_len, args.vocab, args.seed + 1):
        logits = model(seqs[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), seqs[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed |loss difference| at any step (default 1e-4)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    ours = train("numba_flash", args)
    t1 = time.perf_counter()
    ref = train("sdpa", args)
    t2 = time.perf_counter()
    print(f"{'step':>4}  {'numba_flash':>12}  {'torch SDPA':>12}  {'difference':>10}")
    for i, (a, b) in enumerate(zip(ours, ref)):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {a - b:>10.2e}")
    worst = max(abs(a - b) for a, b in zip(ours, ref))
    print(f"max |difference| {worst:.2e}; numba_flash {t1 - t0:.1f} s, SDPA {t2 - t1:.2f} s")
    if worst > args.tolerance:
        print(f"FAIL: the losses differ by more than {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
