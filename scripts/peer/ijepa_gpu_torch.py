#!/usr/bin/env python3
"""PyTorch peer of `jepa_gpu bench` (issue 16): the same I-JEPA step in PyTorch's usual mixed
precision (f32 parameters under bf16 autocast, flash attention through
scaled_dot_product_attention, fused AdamW, TF32 matmuls), eager and torch.compile.

Identical shapes to rustytorch's bench: a ViT-B/16 context encoder (224x224, patch 16, C 768,
12 layers, 12 heads, MLP 4x with tanh-GELU, pre-norm LayerNorm eps 1e-6, learned position
embedding started at 2-D sin-cos) on 100 of the 196 tokens; the EMA target encoder (f32, EMA with
torch._foreach ops after each step) on all 196 tokens, its output layer-normed without affine; a
predictor of width 384, depth 6, 6 heads (head dim 64, as ours), fixed 2-D sin-cos positions, a
learned mask token, run once per target block (4 blocks of 4x8 = 32 tokens) on the repeated
context; smooth L1 loss; AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.05 on matrices); the
collapse monitor (std over the batch of the token-mean context features) read every step, as
ours. Random images (uploaded before the clock starts), masks drawn per step by the same scheme
(target blocks at random places, context from the rest). Median of STEPS steps, each timed to the
loss read-back. FLOPs per image by the same formula as ours (`step_flops`), MFU over 989 TFLOP/s.

Prints `RESULT torch-eager img_s=... step_ms=... mfu=...` and the same for torch-compile.
Usage: ijepa_gpu_torch.py [eager|compile|both] [STEPS] [BATCH]
"""
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PEAK_BF16 = 989e12


def sincos_2d(grid, dim):
    """MAE's 2-D sin-cos table [grid*grid, dim]: first half the column, second half the row."""
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    rows = []
    for r in range(grid):
        for c in range(grid):
            parts = []
            for pos in (c, r):
                parts += [torch.sin(pos * omega), torch.cos(pos * omega)]
            rows.append(torch.cat(parts))
    return torch.stack(rows).float()


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(c, eps=1e-6)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c, eps=1e-6)
        self.fc = nn.Linear(c, 4 * c)
        self.fc2 = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Encoder(nn.Module):
    def __init__(self, c=768, layers=12, heads=12, patch=16, grid=14, in_ch=3):
        super().__init__()
        self.patch = nn.Conv2d(in_ch, c, patch, patch)
        self.pos = nn.Parameter(sincos_2d(grid, c).unsqueeze(0))
        self.blocks = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(c, eps=1e-6)

    def forward(self, images, keep=None):
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        if keep is not None:
            x = torch.gather(x, 1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class Predictor(nn.Module):
    def __init__(self, c=768, p=384, depth=6, heads=6, grid=14):
        super().__init__()
        self.embed = nn.Linear(c, p)
        self.mask_token = nn.Parameter(torch.randn(1, 1, p) * 0.02)
        self.register_buffer("pos", sincos_2d(grid, p), persistent=False)
        self.blocks = nn.ModuleList([Block(p, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(p, eps=1e-6)
        self.proj = nn.Linear(p, c)

    def forward(self, z, context, targets):
        b, kc = context.shape
        m = targets.shape[0] // b
        x = self.embed(z) + self.pos[context]
        x = x.repeat(m, 1, 1)
        queries = self.mask_token + self.pos[targets]
        x = torch.cat([x, queries], 1)
        for blk in self.blocks:
            x = blk(x)
        return self.proj(self.norm(x)[:, kc:])


class IJepa(nn.Module):
    """Encoder, predictor and EMA target encoder; the defaults are the GPU bench's ViT-B/16."""

    def __init__(self, c=768, layers=12, heads=12, patch=16, grid=14, in_ch=3, p=384, depth=6, p_heads=6, loss="smooth_l1"):
        super().__init__()
        self.c, self.loss = c, loss
        self.encoder = Encoder(c, layers, heads, patch, grid, in_ch)
        self.predictor = Predictor(c, p, depth, p_heads, grid)
        self.target = Encoder(c, layers, heads, patch, grid, in_ch)
        self.target.load_state_dict(self.encoder.state_dict())
        self.target.requires_grad_(False)

    def forward(self, images, context, targets):
        c = self.c
        with torch.no_grad():
            h = F.layer_norm(self.target(images), (c,))
            m = targets.shape[0] // images.shape[0]
            h = torch.gather(h.repeat(m, 1, 1), 1, targets.unsqueeze(-1).expand(-1, -1, c))
        z = self.encoder(images, context)
        pred = self.predictor(z, context, targets)
        loss = F.smooth_l1_loss(pred, h) if self.loss == "smooth_l1" else F.mse_loss(pred, h)
        std = z.detach().mean(1).std(0).mean()
        return loss, std


def step_flops(n, kc, m, kt, c, layers, patch_in, p, depth):
    block = lambda t, w: 24.0 * w * w * t + 4.0 * t * t * w
    encoder = lambda t: layers * block(t, c)
    patch = 2.0 * patch_in * c * n
    ctx = 3.0 * encoder(kc) + 2.0 * patch
    tgt = encoder(n) + patch
    s = kc + kt
    pred = 3.0 * m * (2.0 * c * p * kc + depth * block(s, p) + 2.0 * p * c * kt)
    return ctx + tgt + pred


def masks(batch, gen, grid=14, kc=100, m=4, bh=4, bw=8):
    """Fixed-shape masks as rustytorch's `JepaMasks::fixed_blocks` draws them (own generator)."""
    context = torch.empty(batch, kc, dtype=torch.long)
    targets = torch.empty(m, batch, bh * bw, dtype=torch.long)
    for b in range(batch):
        covered = torch.zeros(grid * grid, dtype=torch.bool)
        for k in range(m):
            r0 = int(torch.randint(grid - bh + 1, (1,), generator=gen))
            c0 = int(torch.randint(grid - bw + 1, (1,), generator=gen))
            ids = torch.tensor([(r0 + i) * grid + c0 + j for i in range(bh) for j in range(bw)])
            covered[ids] = True
            targets[k, b] = ids
        free = torch.nonzero(~covered).flatten()
        if free.numel() < kc:
            free = torch.cat([free, torch.nonzero(covered).flatten()])
        pick = free[torch.randperm(free.numel(), generator=gen)[:kc]]
        context[b] = torch.sort(pick).values
    return context, targets.reshape(m * batch, bh * bw)


def main():
    modes = sys.argv[1] if len(sys.argv) > 1 else "both"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    flops = step_flops(196, 100, 4, 32, 768, 12, 3 * 16 * 16, 384, 6) * batch
    for mode in (["eager", "compile"] if modes == "both" else [modes]):
        torch.manual_seed(1)
        model = IJepa().to(dev)
        trained = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in trained if p.dim() >= 2]
        no_decay = [p for p in trained if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95), fused=True)
        src, tgt = list(model.encoder.parameters()), list(model.target.parameters())
        fwd = torch.compile(model) if mode == "compile" else model
        gen = torch.Generator().manual_seed(7)
        warm = 8 if mode == "compile" else 3
        times, total = [], steps + warm
        for i in range(total):
            images = torch.randn(batch, 3, 224, 224, generator=gen).to(dev)
            context, targets = masks(batch, gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            context, targets = context.to(dev), targets.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, std = fwd(images, context, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mom = 0.996 + (1.0 - 0.996) * i / total
            with torch.no_grad():
                torch._foreach_mul_(tgt, mom)
                torch._foreach_add_(tgt, src, alpha=1.0 - mom)
            last, last_std = loss.item(), std.item()
            if i >= warm:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        img_s = batch / med
        mfu = flops / med / PEAK_BF16
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"torch-{mode}: batch {batch}, step median {med * 1e3:.2f} ms (min {min(times) * 1e3:.2f}), {img_s:.0f} images/s, MFU {mfu * 100:.1f}% ({flops / batch / 1e9:.1f} GFLOP per image), last loss {last:.4f}, feature std {last_std:.4f}, peak memory {peak:.2f} GiB")
        print(f"RESULT torch-{mode} batch={batch} img_s={img_s:.0f} step_ms={med * 1e3:.2f} mfu={mfu:.4f}")
        del model, opt, fwd
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
