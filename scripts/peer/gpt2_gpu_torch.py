#!/usr/bin/env python3
"""PyTorch peer of `gpt_gpu bench`: the same GPT-2 124M model (12 layers, C 768, 12 heads,
context 1024, tied head, GELU-tanh, biases, batch 16, AdamW with weight decay on matrices) in
PyTorch's usual mixed precision (f32 parameters, bf16 autocast, flash attention through
scaled_dot_product_attention, fused AdamW, TF32 matmuls), as nanoGPT trains it. Eager and
torch.compile modes. Vocabulary (env VOCAB): `gpt2` (default) is GPT-2's BPE padded to 50,304
rows as nanoGPT/llm.c pad it, trained on the State of the Union token ids that `gpt_gpu` cached
in DATA_DIR/sotu/gpt2-tokens.bin (u16 after a 28-byte header; run `gpt_gpu bench` first);
`bytes` is the byte vocabulary 256 on the raw text. Prints `RESULT` lines:

    RESULT torch-eager tok_s=... step_ms=...
    RESULT torch-compile tok_s=... step_ms=...

Usage: [VOCAB=gpt2|bytes] gpt2_gpu_torch.py DATA_DIR [eager|compile|both] [STEPS]
"""
import glob
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.fc = nn.Linear(c, 4 * c)
        self.fc_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab=256, context=1024, c=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(context, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    data_dir = sys.argv[1]
    modes = sys.argv[2] if len(sys.argv) > 2 else "both"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    vocab_kind = os.environ.get("VOCAB", "gpt2")
    if vocab_kind == "gpt2":
        raw = open(os.path.join(data_dir, "sotu", "gpt2-tokens.bin"), "rb").read()
        if raw[:8] != b"RTXBPE1\0":
            sys.exit("gpt2-tokens.bin: not a token cache (run gpt_gpu bench first)")
        data = torch.frombuffer(bytearray(raw[28:]), dtype=torch.int16).long() & 0xFFFF
        vocab = 50304
    else:
        text = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(data_dir, "sotu", "*.txt"))))
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        vocab = 256
    print(f"torch peer: vocabulary {vocab_kind} ({vocab} rows), {len(data)} tokens")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    b, t = 16, 1024
    gen = torch.Generator().manual_seed(1234)
    for mode in (["eager", "compile"] if modes == "both" else [modes]):
        torch.manual_seed(1234)
        model = Gpt(vocab=vocab).cuda()
        n_params = sum(p.numel() for p in model.parameters())
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95), fused=True)
        fwd = torch.compile(model) if mode == "compile" else model
        times = []
        loss = None
        for i in range(steps + (8 if mode == "compile" else 3)):
            starts = torch.randint(len(data) - t - 1, (b,), generator=gen)
            x = torch.stack([data[s : s + t] for s in starts]).cuda(non_blocking=True)
            y = torch.stack([data[s + 1 : s + t + 1] for s in starts]).cuda(non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y)
            loss.backward()
            opt.step()
            lv = loss.item()
            dt = time.perf_counter() - t0
            if i >= (8 if mode == "compile" else 3):
                times.append(dt)
        med = statistics.median(times)
        tok_s = b * t / med
        flops = 6 * n_params + 12 * 12 * 768 * t
        print(f"torch {mode}: {n_params} parameters, step median {med * 1e3:.2f} ms, {tok_s:.0f} tokens/s, MFU {flops * tok_s / 989e12 * 100:.1f}%, final loss {lv:.4f}")
        print(f"RESULT torch-{mode} tok_s={tok_s:.0f} step_ms={med * 1e3:.2f}")
        del model, opt, fwd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
