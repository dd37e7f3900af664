#!/usr/bin/env python3
"""PyTorch parity of rustytorch's GPT and ViT: a PyTorch state_dict loads and gives the same
outputs and gradients (outside CI; needs `pip install torch safetensors`).

    torch_parity.py write DIR     # DIR/{gpt,vit}_{state,io}.safetensors from plain torch.nn models
    torch_parity.py compare DIR   # reads DIR/{gpt,vit}_rustytorch.safetensors, exits 1 on failure
    torch_parity.py run DIR       # write, `cargo run -p rtx-examples --example torch_parity`, compare

The models are written here in plain torch.nn with rustytorch's parameter names (which are its
`state_dict` names): the GPT is nanoGPT-shaped (tied head, tanh GELU as GPT-2), the ViT has a class
token, class-token pooling and the exact (erf) GELU of `nn.GELU()`. The GPT state is saved in F32;
the ViT state in F16 (the torch model is rounded to F16 first, so both sides hold the same values
and compute in F32), to exercise loading a dtype rustytorch does not store. Inputs are saved as
PyTorch keeps them: token ids and targets as int64, with a quarter of the GPT targets at
`ignore_index = -100`; ViT labels as int64.

Error measure per tensor: max |a - b| (abs) and rel = max|a - b| / max|b|, with b the torch
float32 result; every rel must be <= TOL. For scale it also prints torch float32 against a
float64 torch run of the same model.
"""
import argparse
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

TOL = 2e-4
GPT = dict(vocab=96, context=16, d_model=64, n_layers=2, n_heads=4, eps=1e-5, batch=3, gelu="tanh")
VIT = dict(image=(12, 12), in_channels=2, patch=4, d_model=48, n_layers=2, n_heads=4, classes=7, eps=1e-6, batch=5, gelu="none")


class Attention(nn.Module):
    def __init__(self, c, heads, causal):
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, c, gelu):
        super().__init__()
        self.fc = nn.Linear(c, 4 * c)
        self.proj = nn.Linear(4 * c, c)
        self.gelu = gelu

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate=self.gelu))


class Block(nn.Module):
    def __init__(self, c, heads, causal, eps, gelu):
        super().__init__()
        self.ln1 = nn.LayerNorm(c, eps=eps)
        self.attn = Attention(c, heads, causal)
        self.ln2 = nn.LayerNorm(c, eps=eps)
        self.mlp = FeedForward(c, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    """tok_emb, pos_emb, blocks, ln_f; the head reuses tok_emb.weight (tied, as GPT-2)."""

    def __init__(self, k):
        super().__init__()
        self.tok_emb = nn.Embedding(k["vocab"], k["d_model"])
        self.pos_emb = nn.Embedding(k["context"], k["d_model"])
        self.blocks = nn.ModuleList(Block(k["d_model"], k["n_heads"], True, k["eps"], k["gelu"]) for _ in range(k["n_layers"]))
        self.ln_f = nn.LayerNorm(k["d_model"], eps=k["eps"])

    def forward(self, ids):
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


class PatchEmbed(nn.Module):
    def __init__(self, in_channels, patch, c):
        super().__init__()
        self.proj = nn.Linear(in_channels * patch * patch, c)
        self.patch = patch

    def forward(self, images):
        # Patches in row-major grid order, each flattened (channel, row, column): a Conv2d with
        # kernel and stride p, written as a Linear.
        b, ch, h, w = images.shape
        p = self.patch
        x = images.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.proj(x.reshape(b, (h // p) * (w // p), ch * p * p))


class Vit(nn.Module):
    """cls_token, pos_embed (class token first), patch_embed, blocks, norm, head on the class token."""

    def __init__(self, k):
        super().__init__()
        c = k["d_model"]
        n = (k["image"][0] // k["patch"]) * (k["image"][1] // k["patch"])
        self.cls_token = nn.Parameter(torch.randn(1, 1, c) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, c) * 0.02)
        self.patch_embed = PatchEmbed(k["in_channels"], k["patch"], c)
        self.blocks = nn.ModuleList(Block(c, k["n_heads"], False, k["eps"], k["gelu"]) for _ in range(k["n_layers"]))
        self.norm = nn.LayerNorm(c, eps=k["eps"])
        self.head = nn.Linear(c, k["classes"])

    def forward(self, images):
        x = self.patch_embed(images) + self.pos_embed[:, 1:]
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def spread_norms(model, g):
    """Norm scales away from 1 and shifts away from 0, so their gradients matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith(("ln_f", "norm")):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))


def run_model(model, inputs, loss_fn):
    model.zero_grad()
    logits = model(inputs["x"])
    loss = loss_fn(logits)
    loss.backward()
    grads = {f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach().reshape(1), **grads}


def gpt_case(g):
    k = GPT
    model = Gpt(k)
    spread_norms(model, g)
    ids = torch.randint(0, k["vocab"], (k["batch"], k["context"]), generator=g)
    targets = torch.randint(0, k["vocab"], (k["batch"], k["context"]), generator=g)
    targets[torch.rand(targets.shape, generator=g) < 0.25] = -100
    assert ids.dtype == torch.int64 and (targets == -100).any()
    meta = {"n_heads": str(k["n_heads"]), "layer_norm_eps": str(k["eps"]), "gelu": k["gelu"]}

    def loss_fn(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, {"x": ids}, loss_fn, {"ids": ids, "targets": targets}, meta, torch.float32


def vit_case(g):
    k = VIT
    model = Vit(k)
    spread_norms(model, g)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    images = torch.randn(k["batch"], k["in_channels"], *k["image"], generator=g)
    labels = torch.randint(0, k["classes"], (k["batch"],), generator=g)
    meta = {"n_heads": str(k["n_heads"]), "layer_norm_eps": str(k["eps"]), "gelu": k["gelu"], "patch_size": str(k["patch"])}

    def loss_fn(logits):
        return F.cross_entropy(logits, labels)

    return model, {"x": images}, loss_fn, {"images": images, "labels": labels}, meta, torch.float16


CASES = {"gpt": gpt_case, "vit": vit_case}


def write(d):
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    for name, case in CASES.items():
        model, inputs, loss_fn, io, meta, state_dtype = case(g)
        ref = run_model(model, inputs, loss_fn)
        state = {n: t.detach().to(state_dtype).contiguous() for n, t in model.state_dict().items()}
        save_file(state, os.path.join(d, f"{name}_state.safetensors"))
        save_file({**io, **{f"ref.{n}": t for n, t in ref.items()}}, os.path.join(d, f"{name}_io.safetensors"), metadata=meta)
        model64 = model.double()
        inputs64 = {"x": inputs["x"].double() if inputs["x"].is_floating_point() else inputs["x"]}
        ref64 = run_model(model64, inputs64, lambda logits: loss_fn(logits))
        save_file({n: t for n, t in ref64.items()}, os.path.join(d, f"{name}_ref64.safetensors"))
        print(f"{name}: wrote state ({len(state)} tensors, {state_dtype}) and inputs to {d}")


def compare(d):
    ok = True
    rows = []
    for name in CASES:
        io = load_file(os.path.join(d, f"{name}_io.safetensors"))
        ref = {n[len("ref."):]: t for n, t in io.items() if n.startswith("ref.")}
        ref64 = load_file(os.path.join(d, f"{name}_ref64.safetensors"))
        rtx = load_file(os.path.join(d, f"{name}_rustytorch.safetensors"))
        missing = sorted(set(ref) ^ set(rtx))
        if missing:
            print(f"{name}: tensors on one side only: {missing}")
            ok = False
        worst = (0.0, 0.0, "")
        for t in sorted(set(ref) & set(rtx)):
            a, b, c = rtx[t].double(), ref[t].double(), ref64[t].double()
            if a.shape != b.shape:
                print(f"{name}.{t}: shape {tuple(a.shape)} vs torch {tuple(b.shape)}")
                ok = False
                continue
            scale = b.abs().max().item() or 1.0
            abs_err = (a - b).abs().max().item()
            rel = abs_err / scale
            rel_torch32 = (b - c).abs().max().item() / scale
            rows.append((f"{name}.{t}", abs_err, rel, rel_torch32))
            if not rel <= TOL:
                ok = False
            if rel >= worst[1]:
                worst = (abs_err, rel, t)
        print(f"{name}: worst {worst[2]}: max abs {worst[0]:.3e}, rel {worst[1]:.3e}")
    print(f"{'tensor':48} {'max abs':>10} {'rel':>10} {'torch32 vs 64':>14}")
    for t, a, r, r32 in rows:
        flag = "" if r <= TOL else "  <-- over tolerance"
        print(f"{t:48} {a:10.3e} {r:10.3e} {r32:14.3e}{flag}")
    print("PASS" if ok else "FAIL", f"(tolerance rel {TOL:g})")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["write", "compare", "run"])
    p.add_argument("dir")
    a = p.parse_args()
    if a.cmd in ("write", "run"):
        write(a.dir)
    if a.cmd == "run":
        subprocess.run(["cargo", "run", "-q", "-p", "rtx-examples", "--example", "torch_parity", "--", a.dir], check=True)
    if a.cmd in ("compare", "run"):
        sys.exit(0 if compare(a.dir) else 1)


if __name__ == "__main__":
    main()
