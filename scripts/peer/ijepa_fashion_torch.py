#!/usr/bin/env python3
"""PyTorch peer of `rtx train configs/ijepa_fashion.toml` (issue 16): the same I-JEPA trained on
Fashion-MNIST on the CPU, then the same frozen-feature probes, so the probe accuracies of the two
implementations can be compared at the same step budget (outside CI; needs the torch venv of
scripts/peer/setup-torch-venv.sh).

    ijepa_fashion_torch.py [--steps 3500] [--seed 0] [--threads 2] [--probe-every 1000] [--out FILE]

What is identical to rustytorch (read off src/train/jepa.rs, src/train/optimizer.rs,
tensor/src/nn/jepa/, tensor/src/data/): the model (ViT 28x28, patch 4, width 64, 4 blocks of 4
heads, tanh-GELU MLP 4x, pre-norm LayerNorm eps 1e-6, learned positions started at 2-D sin-cos;
predictor 3 x 48 with 4 heads, fixed sin-cos positions, learned mask token; EMA target encoder
whose output is layer-normed without affine; L2 latent loss), the init (every weight, the mask
token N(0, 0.02), biases 0, LayerNorm 1/0), the masks (I-JEPA multi-block: one target size and
one context size per batch, 4 targets at scale 0.15-0.2 and aspect 0.75-1.5 log-uniform, context
at scale 0.85-1.0 minus the targets, 20 tries for >= 4 context tokens, contexts trimmed to the
batch's smallest), the data (54,000 / 6,000 seeded train/validation split, pixels /255
standardised by the train split's mean and std, a fresh seeded shuffle every epoch, batches of
128 with the short last one kept), the optimizer (AdamW betas 0.9/0.95, eps 1e-8, weight decay on
tensors of rank >= 2 only, cosine 0.04 -> 0.4 over the run; learning rate 1.5e-3 with 200 linear
warmup steps then cosine to 1e-5; global gradient-norm clip 1.0), the EMA momentum (linear 0.996
-> 1.0, applied after each optimizer step with the momentum of step + 1), and the probes
(readouts mean / grid2 / grid3 / mean-last4 / tokens; a linear probe = multinomial logistic
regression on train-standardised features, AdamW lr 1e-2 cosine to 0, weight decay 1e-4,
batches of 256, 20 epochs and at least 600 steps, PyTorch's default Linear init; k-NN with k 20
on cosine similarity, votes exp(sim / 0.07); the same on raw pixels as the baseline).

What is not identical, by decision: the random streams. rustytorch draws from its own seeded
generator (src: tensor/src/rng.rs); this script draws the same distributions from
torch.Generator seeded by --seed. Bit-identical inputs would compare two float libraries; the
question here is whether the two implementations learn equally well, so the comparison is at the
accuracy level, and the spread between seeds of this script says how much of a gap is noise.

Prints one JSON line per probe (`{"step": ..., "readout": ..., "probe_acc": ..., "knn_acc": ...}`)
and a final summary line; --out appends the same lines to a file.
"""
import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ijepa_gpu_torch import IJepa  # noqa: E402

GRID, PATCH, WIDTH, LAYERS, HEADS = 7, 4, 64, 4, 4
PRED_WIDTH, PRED_DEPTH, PRED_HEADS = 48, 3, 4
BATCH, VAL_FRACTION = 128, 0.1
LR, MIN_LR, WARMUP, BETAS, WD0, WD1, CLIP = 1.5e-3, 1e-5, 200, (0.9, 0.95), 0.04, 0.4, 1.0
EMA = (0.996, 1.0)
N_TARGETS, TARGET_SCALE, TARGET_ASPECT, CONTEXT_SCALE, MIN_KEEP, MAX_TRIES = 4, (0.15, 0.2), (0.75, 1.5), (0.85, 1.0), 4, 20
PROBE_LR, PROBE_WD, PROBE_BATCH, PROBE_EPOCHS, PROBE_MIN_STEPS, KNN_K, KNN_T = 1e-2, 1e-4, 256, 20, 600, 20, 0.07
READOUTS = ["mean", "grid2", "grid3", "mean-last4", "tokens"]


def load_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_fashion(root):
    d = os.path.join(root, "fashion-mnist")
    tr_x = load_idx(os.path.join(d, "train-images-idx3-ubyte.gz"))
    tr_y = load_idx(os.path.join(d, "train-labels-idx1-ubyte.gz"))
    te_x = load_idx(os.path.join(d, "t10k-images-idx3-ubyte.gz"))
    te_y = load_idx(os.path.join(d, "t10k-labels-idx1-ubyte.gz"))
    return tr_x, tr_y, te_x, te_y


def init_like_rustytorch(model):
    """Every Linear/Conv weight N(0, 0.02) and bias 0 (`Linear::normal`); LayerNorm stays 1/0;
    positions stay sin-cos; the mask token is already N(0, 0.02)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.zeros_(m.bias)
    model.target.load_state_dict(model.encoder.state_dict())


def block_size(scale, aspect, g):
    s = scale[0] + float(torch.rand((), generator=g)) * (scale[1] - scale[0])
    area = s * GRID * GRID
    ar = math.exp(math.log(aspect[0]) + float(torch.rand((), generator=g)) * (math.log(aspect[1]) - math.log(aspect[0])))
    h, w = round(math.sqrt(area * ar)), round(math.sqrt(area / ar))
    hi = GRID if s >= 1.0 else max(GRID - 1, 1)
    return min(max(h, 1), hi), min(max(w, 1), hi)


def place(block, g):
    bh, bw = block
    top = int(torch.randint(GRID - bh + 1, (), generator=g))
    left = int(torch.randint(GRID - bw + 1, (), generator=g))
    return [(r * GRID + c) for r in range(top, top + bh) for c in range(left, left + bw)]


def sample_masks(batch, g):
    """I-JEPA multi-block masks as `MaskConfig::sample` draws them (own stream)."""
    tblock = block_size(TARGET_SCALE, TARGET_ASPECT, g)
    cblock = block_size(CONTEXT_SCALE, (1.0, 1.0), g)
    targets, contexts = [], []
    for _ in range(batch):
        for _ in range(MAX_TRIES):
            blocks = [place(tblock, g) for _ in range(N_TARGETS)]
            covered = set(i for b in blocks for i in b)
            context = [i for i in place(cblock, g) if i not in covered]
            if len(context) >= MIN_KEEP:
                break
        if len(context) < MIN_KEEP:
            context = [i for i in range(GRID * GRID) if i not in covered]
        targets.append(blocks)
        contexts.append(context)
    kc = min(len(c) for c in contexts)
    context = torch.tensor([c[:kc] for c in contexts], dtype=torch.long)
    target = torch.tensor([targets[b][m] for m in range(N_TARGETS) for b in range(batch)], dtype=torch.long)
    return context, target


def lr_at(step, total):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    if step > total or total <= WARMUP:
        return MIN_LR
    ratio = (step - WARMUP) / (total - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def wd_at(step, total):
    t = min(step / max(total, 1), 1.0)
    return WD1 + 0.5 * (WD0 - WD1) * (1.0 + math.cos(math.pi * t))


def encoder_readouts(encoder, images):
    """Every readout of `images` from one pass: the final tokens and the last 4 blocks' normed outputs."""
    x = encoder.patch(images).flatten(2).transpose(1, 2) + encoder.pos
    kept = []
    for i, blk in enumerate(encoder.blocks):
        x = blk(x)
        if i >= len(encoder.blocks) - 4:
            kept.append(encoder.norm(x))
    last = kept[-1]
    b = last.shape[0]
    out = {"mean": last.mean(1), "tokens": last.reshape(b, -1), "mean-last4": torch.cat([k.mean(1) for k in kept], 1)}
    grid = last.reshape(b, GRID, GRID, -1)
    for name, r in (("grid2", 2), ("grid3", 3)):
        edges = [(2 * i * GRID + r) // (2 * r) for i in range(r + 1)]
        regions = [grid[:, edges[i]:edges[i + 1], edges[j]:edges[j + 1]].mean((1, 2)) for i in range(r) for j in range(r)]
        out[name] = torch.cat(regions, 1)
    return out


def features(encoder, images):
    encoder.eval()
    outs = {k: [] for k in READOUTS}
    with torch.no_grad():
        for i in range(0, images.shape[0], 500):
            r = encoder_readouts(encoder, images[i:i + 500])
            for k in READOUTS:
                outs[k].append(r[k])
    encoder.train()
    return {k: torch.cat(v) for k, v in outs.items()}


def linear_probe(train_x, train_y, test_x, test_y, n_classes, seed):
    mu = train_x.double().mean(0)
    var = ((train_x.double() - mu) ** 2).mean(0)
    inv = (1.0 / torch.sqrt(var + 1e-6)).float()
    mu = mu.float()
    tr, te = (train_x - mu) * inv, (test_x - mu) * inv
    g = torch.Generator().manual_seed(seed + 4)
    torch.manual_seed(seed + 4)
    head = nn.Linear(tr.shape[1], n_classes)
    opt = torch.optim.AdamW(head.parameters(), lr=PROBE_LR, weight_decay=PROBE_WD)
    n = tr.shape[0]
    per_epoch = math.ceil(n / PROBE_BATCH)
    epochs = max(PROBE_EPOCHS, math.ceil(PROBE_MIN_STEPS / per_epoch))
    total, step = max(epochs * per_epoch, 1), 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, PROBE_BATCH):
            rows = order[i:i + PROBE_BATCH]
            loss = F.cross_entropy(head(tr[rows]), train_y[rows])
            opt.zero_grad()
            loss.backward()
            for group in opt.param_groups:
                group["lr"] = PROBE_LR * 0.5 * (1.0 + math.cos(math.pi * step / total))
            opt.step()
            step += 1
    with torch.no_grad():
        return (head(te).argmax(1) == test_y).float().mean().item()


def knn(train_x, train_y, test_x, test_y, n_classes):
    tr = F.normalize(train_x, dim=1, eps=1e-12)
    te = F.normalize(test_x, dim=1, eps=1e-12)
    correct = 0
    with torch.no_grad():
        for i in range(0, te.shape[0], 500):
            sims = te[i:i + 500] @ tr.T
            top, idx = sims.topk(KNN_K, dim=1)
            votes = torch.zeros(sims.shape[0], n_classes, dtype=torch.float64)
            votes.scatter_add_(1, train_y[idx], torch.exp(top.double() / KNN_T))
            correct += (votes.argmax(1) == test_y[i:i + 500]).sum().item()
    return correct / te.shape[0]


def probe_all(encoder, train_img, train_y, test_img, test_y, seed):
    tr_f, te_f = features(encoder, train_img), features(encoder, test_img)
    return {k: (linear_probe(tr_f[k], train_y, te_f[k], test_y, 10, seed), knn(tr_f[k], train_y, te_f[k], test_y, 10)) for k in READOUTS}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-every", type=int, default=1000)
    ap.add_argument("--probe-images", type=int, default=10000, help="train images of the periodic probes")
    ap.add_argument("--data-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"seed {args.seed} (replay: --seed {args.seed}), torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    def emit(**fields):
        line = json.dumps(fields)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    tr_x, tr_y, te_x, te_y = load_fashion(args.data_dir)
    split = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(tr_x.shape[0], generator=split)
    n_val = round(tr_x.shape[0] * VAL_FRACTION)
    train_idx = torch.sort(order[n_val:]).values
    train_u8 = torch.from_numpy(tr_x.copy())[train_idx]
    mean = (train_u8.double() / 255).mean().item()
    std = (train_u8.double() / 255).std(unbiased=False).item()
    norm = lambda u8: ((u8.float() / 255 - mean) / std).unsqueeze(1)
    train_img, test_img = norm(train_u8), norm(torch.from_numpy(te_x.copy()))
    train_lab = torch.from_numpy(tr_y.astype(np.int64))[train_idx]
    test_lab = torch.from_numpy(te_y.astype(np.int64))
    n = train_img.shape[0]

    torch.manual_seed(args.seed)
    model = IJepa(c=WIDTH, layers=LAYERS, heads=HEADS, patch=PATCH, grid=GRID, in_ch=1, p=PRED_WIDTH, depth=PRED_DEPTH, p_heads=PRED_HEADS, loss="l2")
    init_like_rustytorch(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD0}, {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=1e-8)
    src, tgt = list(model.encoder.parameters()), list(model.target.parameters())
    data_g = torch.Generator().manual_seed(args.seed + 1)
    mask_g = torch.Generator().manual_seed(args.seed + 3)
    epoch_order, cursor = torch.randperm(n, generator=data_g), 0
    t_train, t0 = 0.0, time.perf_counter()
    for step in range(args.steps):
        if cursor >= n:
            epoch_order, cursor = torch.randperm(n, generator=data_g), 0
        rows = epoch_order[cursor:cursor + BATCH]
        cursor += BATCH
        context, targets = sample_masks(rows.numel(), mask_g)
        loss, fstd = model(train_img[rows], context, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps)
            if group["weight_decay"] > 0:
                group["weight_decay"] = wd_at(step, args.steps)
        opt.step()
        mom = EMA[0] + (EMA[1] - EMA[0]) * min((step + 1) / args.steps, 1.0)
        with torch.no_grad():
            torch._foreach_mul_(tgt, mom)
            torch._foreach_add_(tgt, src, alpha=1.0 - mom)
        if step % 50 == 0 or step + 1 == args.steps:
            emit(step=step, loss=round(loss.item(), 5), feature_std=round(fstd.item(), 4), lr=lr_at(step, args.steps), elapsed_s=round(time.perf_counter() - t0, 1))
        if args.probe_every and (step + 1) % args.probe_every == 0 and step + 1 < args.steps:
            t_train += time.perf_counter() - t0
            k = args.probe_images
            for name, (p, kn) in probe_all(model.encoder, train_img[:k], train_lab[:k], test_img, test_lab, args.seed).items():
                emit(step=step + 1, readout=name, probe_acc=round(p, 4), knn_acc=round(kn, 4), train_images=k)
            t0 = time.perf_counter()
    t_train += time.perf_counter() - t0
    final = probe_all(model.encoder, train_img, train_lab, test_img, test_lab, args.seed)
    for name, (p, kn) in final.items():
        emit(step=args.steps, readout=name, probe_acc=round(p, 4), knn_acc=round(kn, 4), train_images=n)
    pixel = linear_probe(train_img.reshape(n, -1), train_lab, test_img.reshape(test_img.shape[0], -1), test_lab, 10, args.seed)
    emit(final=True, seed=args.seed, steps=args.steps, train_seconds=round(t_train, 1), pixel_probe_acc=round(pixel, 4), **{f"{k}_probe_acc": round(v[0], 4) for k, v in final.items()})


if __name__ == "__main__":
    main()
