#!/usr/bin/env python3
"""PyTorch side of `scripts/bench-vs-torch.sh`: the same benchmarks as `rtx bench`, same shapes.

    torch_bench.py matmul [--warmup 2] [--repeats 7]
    torch_bench.py step --model mlp|gpt|ijepa [--warmup 3] [--repeats 15]
    torch_bench.py ops --model mlp|gpt  # each op of the step alone (see src/bench/ops.rs)

Threads: torch.set_num_threads(RTX_NUM_THREADS, default all cores), interop threads 1.
Prints one JSON object per line with the same fields as rustytorch's `rtx bench` (impl="torch").
The models mirror rustytorch's `nn::Mlp` and `nn::Gpt` (see tensor/src/nn/): keep them in step.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def threads():
    n = os.environ.get("RTX_NUM_THREADS") or os.environ.get("RAYON_NUM_THREADS")
    return int(n) if n and int(n) > 0 else os.cpu_count()


def measure(warmup, repeats, f):
    for _ in range(warmup):
        f()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {
        "median_ms": round(statistics.median(samples), 3),
        "min_ms": round(samples[0], 3),
        "max_ms": round(samples[-1], 3),
        "repeats": len(samples),
    }


def emit(**fields):
    print(json.dumps(dict(sorted(fields.items()))), flush=True)


# ------------------------------------------------------------------------------------ matmul

def bench_matmul(args):
    g = torch.Generator().manual_seed(0)
    for spec in args.shapes.split(","):
        m, n, k = (int(d) for d in spec.split("x"))
        a = torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g)
        out = torch.empty(m, n)
        flop = 2.0 * m * n * k
        tensor_stats = measure(args.warmup, args.repeats, lambda: torch.matmul(a, b))
        kernel_stats = measure(args.warmup, args.repeats, lambda: torch.matmul(a, b, out=out))
        for variant, st in (("tensor", tensor_stats), ("kernel", kernel_stats)):
            emit(impl="torch", bench="matmul", variant=variant, shape=f"{m}x{n}x{k}", threads=torch.get_num_threads(),
                 gflops=round(flop / (st["median_ms"] * 1e-3) / 1e9, 3), **st)


# ------------------------------------------------------------------------------------ models

class Mlp(nn.Module):
    """rustytorch nn::Mlp: Linear layers named layers.0..; activation between, none after the last."""

    def __init__(self, sizes, activation):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.activation = activation

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x


class Attention(nn.Module):
    """rustytorch nn::MultiHeadAttention: fused qkv [3C, C] split q|k|v, causal SDPA, proj."""

    def __init__(self, d, n_heads):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.n_heads = n_heads

    def forward(self, x):
        b, t, c = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """rustytorch nn::TransformerBlock: x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, d, n_heads, hidden):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = FeedForward(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    """rustytorch nn::Gpt: token + learned position embeddings, pre-norm blocks, final norm, head."""

    def __init__(self, vocab, ctx, d, n_layers, n_heads, tie):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, n_heads, 4 * d) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.tok_emb.weight
        for name, p in self.named_parameters():
            if name.endswith(".weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# Shapes: keep equal to src/bench/step.rs.
MLP_SIZES = [784, 512, 512, 10]
MLP_BATCH = 128
GPT = dict(vocab=256, ctx=128, d=256, n_layers=4, n_heads=4)
GPT_BATCH = 16
LR, WEIGHT_DECAY = 1e-3, 0.01


def bench_ijepa_step(args):
    """rustytorch's `rtx bench step --model ijepa` (src/bench/jepa_step.rs): configs/ijepa_fashion.toml's
    I-JEPA (ViT 28x28 patch 4 d64 L4 h4, predictor 3x48 h4, L2), 4 targets of 3x3, 20 context tokens,
    batch 128, AdamW (wd 0.04 on matrices, betas 0.9/0.95), EMA, zero_grad; fixed batch and masks."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ijepa_gpu_torch import IJepa, masks

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = 128
    model = IJepa(c=64, layers=4, heads=4, patch=4, grid=7, in_ch=1, p=48, depth=3, p_heads=4, loss="l2")
    images = torch.randn(batch, 1, 28, 28, generator=g)
    context, targets = masks(batch, g, grid=7, kc=20, m=4, bh=3, bw=3)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in trained if p.dim() >= 2], "weight_decay": 0.04},
                             {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    src, tgt = list(model.encoder.parameters()), list(model.target.parameters())
    n_params = sum(p.numel() for p in trained)
    state = {"step": 0}

    def step():
        loss, std = model(images, context, targets)
        loss.backward()
        opt.step()
        mom = 0.996 + (1.0 - 0.996) * state["step"] / 1000
        with torch.no_grad():
            torch._foreach_mul_(tgt, mom)
            torch._foreach_add_(tgt, src, alpha=1.0 - mom)
        opt.zero_grad()
        state["step"] += 1
        assert math.isfinite(loss.item()) and math.isfinite(std.item())
        return loss

    st = measure(args.warmup, args.repeats, step)
    shape = "ijepa vit 28x28 p4 d64 L4 h4, context 20 of 49, 4 targets of 3x3, predictor 3x48 h4, batch 128"
    emit(impl="torch", bench="step", model="ijepa", shape=shape, params=n_params, threads=torch.get_num_threads(), **st)


def bench_step(args):
    if args.model == "ijepa":
        return bench_ijepa_step(args)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if args.model == "mlp":
        model = Mlp(MLP_SIZES, torch.relu)
        x = torch.randn(MLP_BATCH, MLP_SIZES[0], generator=g)
        y = torch.randint(0, MLP_SIZES[-1], (MLP_BATCH,), generator=g)
        shape = f"mlp {'-'.join(map(str, MLP_SIZES))} batch {MLP_BATCH}"
    else:
        model = Gpt(**GPT, tie=args.tie)
        x = torch.randint(0, GPT["vocab"], (GPT_BATCH, GPT["ctx"]), generator=g)
        y = torch.randint(0, GPT["vocab"], (GPT_BATCH, GPT["ctx"]), generator=g)
        shape = f"gpt L{GPT['n_layers']} d{GPT['d']} h{GPT['n_heads']} T{GPT['ctx']} batch {GPT_BATCH} vocab {GPT['vocab']}"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    n_params = sum(p.numel() for p in model.parameters())

    def step():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    st = measure(args.warmup, args.repeats, step)
    emit(impl="torch", bench="step", model=args.model, shape=shape, params=n_params, threads=torch.get_num_threads(), **st)


# ------------------------------------------------------------------------------------ ops

def leaf(*shape, std=1.0, g=None):
    return (torch.randn(*shape, generator=g) * std).requires_grad_(True)


def linear_op(name, count, rows, d_in, d_out, g):
    return (name, count, [leaf(*rows, d_in, g=g), leaf(d_out, d_in, std=0.02, g=g), leaf(d_out, std=0.02, g=g)],
            lambda t: F.linear(t[0], t[1], t[2]))


def mlp_ops(g):
    b = 128
    y = torch.randint(0, 10, (b,), generator=g)
    return [
        linear_op("linear 128x784->512", 1, [b], 784, 512, g),
        linear_op("linear 128x512->512", 1, [b], 512, 512, g),
        linear_op("linear 128x512->10", 1, [b], 512, 10, g),
        ("relu [128,512]", 2, [leaf(b, 512, g=g)], lambda t: torch.relu(t[0])),
        ("cross_entropy [128,10]", 1, [leaf(b, 10, g=g), y], lambda t: F.cross_entropy(t[0], t[1])),
    ]


def gpt_ops(g):
    b, t, c, h, v, layers = 16, 128, 256, 4, 256, 4
    d = c // h
    ids = torch.randint(0, v, (b, t), generator=g)
    pos = torch.arange(t)
    y = torch.randint(0, v, (b * t,), generator=g)

    def attention(x):
        q, k, vv = x[0].view(b, t, 3, h, d).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, vv, is_causal=True).transpose(1, 2).reshape(b, t, c)

    return [
        ("embedding tok+pos [16,128,256]", 1, [leaf(v, c, std=0.02, g=g), leaf(t, c, std=0.02, g=g), ids, pos],
         lambda x: F.embedding(x[2], x[0]) + F.embedding(x[3], x[1])),
        ("layer_norm [16,128,256]", 2 * layers + 1, [leaf(b, t, c, g=g), leaf(c, g=g), leaf(c, std=0.1, g=g)],
         lambda x: F.layer_norm(x[0], (c,), x[1], x[2], 1e-5)),
        linear_op("linear qkv 2048x256->768", layers, [b, t], c, 3 * c, g),
        ("attention core (split heads, causal sdpa, merge)", layers, [leaf(b, t, 3 * c, g=g)], attention),
        linear_op("linear attn.proj 2048x256->256", layers, [b, t], c, c, g),
        linear_op("linear mlp.fc 2048x256->1024", layers, [b, t], c, 4 * c, g),
        ("gelu [16,128,1024]", layers, [leaf(b, t, 4 * c, g=g)], lambda x: F.gelu(x[0], approximate="tanh")),
        linear_op("linear mlp.proj 2048x1024->256", layers, [b, t], 4 * c, c, g),
        ("residual add [16,128,256]", 2 * layers, [leaf(b, t, c, g=g), leaf(b, t, c, g=g)], lambda x: x[0] + x[1]),
        ("tied lm_head 2048x256 @ [256,256]^T", 1, [leaf(b, t, c, g=g), leaf(v, c, std=0.02, g=g)], lambda x: x[0] @ x[1].t()),
        ("cross_entropy [2048,256]", 1, [leaf(b * t, v, g=g), y], lambda x: F.cross_entropy(x[0], x[1])),
    ]


def bench_ops(args):
    g = torch.Generator().manual_seed(0)
    ops = mlp_ops(g) if args.model == "mlp" else gpt_ops(g)
    total = 0.0
    for name, count, inputs, body in ops:
        grad_out = torch.randn(body(inputs).shape, generator=g)

        def fwd_bwd():
            body(inputs).backward(grad_out)
            for x in inputs:
                x.grad = None

        fwd = measure(args.warmup, args.repeats, lambda: body(inputs))
        fb = measure(args.warmup, args.repeats, fwd_bwd)
        total += count * fb["median_ms"]
        emit(impl="torch", bench="ops", model=args.model, op=name, count=count, threads=torch.get_num_threads(),
             fwd_ms=fwd["median_ms"], fwd_bwd_ms=fb["median_ms"], repeats=args.repeats)
    if args.model == "gpt":
        model = Gpt(**GPT, tie=True)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        st = measure(args.warmup, args.repeats, opt.step)
        total += st["median_ms"]
        emit(impl="torch", bench="ops", model=args.model, op="adamw step (3.26M params)", count=1, threads=torch.get_num_threads(),
             fwd_ms=st["median_ms"], fwd_bwd_ms=st["median_ms"], repeats=args.repeats)
    emit(impl="torch", bench="ops", model=args.model, op="sum (count x fwd_bwd)", count=1, threads=torch.get_num_threads(),
         fwd_ms=None, fwd_bwd_ms=round(total, 3))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pm = sub.add_parser("matmul")
    pm.add_argument("--warmup", type=int, default=2)
    pm.add_argument("--repeats", type=int, default=7)
    pm.add_argument("--shapes", default="1024x1024x1024,4096x4096x1024", help="MxNxK,... (lhs MxK, rhs KxN)")
    ps = sub.add_parser("step")
    ps.add_argument("--model", choices=["mlp", "gpt", "ijepa"], required=True)
    ps.add_argument("--warmup", type=int, default=3)
    ps.add_argument("--repeats", type=int, default=15)
    ps.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True, help="tie lm_head to tok_emb (as rustytorch's Gpt)")
    po = sub.add_parser("ops", help="each op of a model's step alone, forward and forward+backward")
    po.add_argument("--model", choices=["mlp", "gpt"], required=True)
    po.add_argument("--warmup", type=int, default=3)
    po.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(threads())
    torch.set_num_interop_threads(1)
    {"matmul": bench_matmul, "step": bench_step, "ops": bench_ops}[args.cmd](args)


if __name__ == "__main__":
    main()
