#!/usr/bin/env python3
"""Peer correctness check of one pre-norm transformer block against PyTorch (float32).

    peer_block.py write DIR     # DIR/block_inputs.safetensors: block parameters + x + w_fixed
    peer_block.py compare DIR   # reads DIR/block_rustytorch.safetensors, compares, exits 1 on failure

The block is rustytorch's `nn::TransformerBlock` (tensor/src/nn/transformer.rs):
    h = x + attn.proj(SDPA_causal(split(attn.qkv(ln1(x)))))
    y = h + mlp.proj(gelu_tanh(mlp.fc(ln2(h))))
with parameter names ln1.{weight,bias}, attn.qkv.{weight,bias} [3C, C] (q|k|v, heads of C/H),
attn.proj.*, ln2.*, mlp.fc.* [4C, C], mlp.proj.* [C, 4C]. The loss is sum(y * w_fixed).
rustytorch writes `out` (y), `grad.x` and `grad.<param name>` for every parameter.

Error measure per tensor: rel = max|a - b| / max|b| with b = torch float32; the check passes
when every rel <= 1e-5. For context it also prints each side's error against a float64 torch run.
"""
import argparse
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

B, T, C, H = 2, 16, 64, 4
HIDDEN = 4 * C
EPS = 1e-5
TOL = 1e-5
INPUTS = "block_inputs.safetensors"
RTX_OUT = "block_rustytorch.safetensors"


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, c // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, HIDDEN)
        self.proj = nn.Linear(HIDDEN, C)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(C, eps=EPS)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(C, eps=EPS)
        self.mlp = FeedForward()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def write(d):
    g = torch.Generator().manual_seed(1234)
    block = Block()
    tensors = {}
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("ln"):
                # Norm scales away from 1 and shifts away from 0, so their gradients matter.
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            tensors[name] = p.detach().clone().contiguous()
    tensors["x"] = torch.randn(B, T, C, generator=g)
    tensors["w_fixed"] = torch.randn(B, T, C, generator=g)
    meta = {"n_heads": str(H), "layer_norm_eps": repr(EPS), "causal": "true"}
    save_file(tensors, f"{d}/{INPUTS}", metadata=meta)
    print(f"wrote {d}/{INPUTS}: {len(tensors) - 2} parameters, x {list(tensors['x'].shape)}")


def reference(inputs, dtype):
    """y and every gradient (x and parameters) of sum(y * w_fixed) in `dtype`."""
    block = Block().to(dtype)
    params = dict(block.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(inputs[name].to(dtype))
    x = inputs["x"].detach().to(dtype).clone().requires_grad_(True)
    y = block(x)
    (y * inputs["w_fixed"].to(dtype)).sum().backward()
    out = {"out": y.detach(), "grad.x": x.grad}
    out.update({f"grad.{n}": p.grad for n, p in params.items()})
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(d):
    inputs = load_file(f"{d}/{INPUTS}")
    rtx = load_file(f"{d}/{RTX_OUT}")
    torch32 = reference(inputs, torch.float32)
    torch64 = reference(inputs, torch.float64)
    missing = sorted(set(torch32) - set(rtx))
    if missing:
        print(f"rustytorch output lacks {missing}", file=sys.stderr)
        return 1
    worst, failed = 0.0, []
    print(f"{'tensor':<22} {'shape':<14} {'rel vs torch f32':>17} {'rtx vs f64':>11} {'torch32 vs f64':>15}")
    for name in sorted(torch32):
        a, b = rtx[name], torch32[name]
        if list(a.shape) != list(b.shape):
            print(f"{name}: shape {list(a.shape)} != torch {list(b.shape)}", file=sys.stderr)
            return 1
        r = rel(a, b)
        worst = max(worst, r)
        if not r <= TOL:
            failed.append(name)
        print(f"{name:<22} {str(list(b.shape)):<14} {r:>17.3e} {rel(a, torch64[name]):>11.3e} {rel(b, torch64[name]):>15.3e}")
    print(json.dumps({"check": "peer_block", "tensors": len(torch32), "max_rel_err": worst, "tolerance": TOL, "passed": not failed}))
    if failed:
        print(f"FAILED: {failed} exceed {TOL}", file=sys.stderr)
        return 1
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["write", "compare"])
    p.add_argument("dir")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.cmd == "write":
        write(a.dir)
        return 0
    return compare(a.dir)


if __name__ == "__main__":
    sys.exit(main())
