"""The reference federated workload of issue 15 in numpy, shared by scripts/peer/flower_fed.py
(imported by every Ray worker, so its data cache is per worker process, not pickled per call).

Logistic regression 784 -> 10 (weights [784, 10] and bias), softmax cross-entropy averaged over
the batch, pixels / 255; client c holds Fashion-MNIST training images
splitmix64(42 + 8c + j) mod 60000, j = 0..8; 1 epoch of SGD lr 0.1 batch 8 in j order.
"""

import gzip
import os

import numpy as np

MASK = (1 << 64) - 1
DATA = os.environ.get("RTX_DATA_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "data"))
SEED = 42
PER_CLIENT = 8
LR = 0.1
BATCH = 8

_cache = {}


def splitmix64(x):
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _idx(name, offset):
    with gzip.open(os.path.join(DATA, "fashion-mnist", name)) as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def data(split):
    """Images as bytes and int64 labels, loaded once per process (each Ray worker imports this
    module, so the cache lives as long as the worker)."""
    if split not in _cache:
        prefix = "train" if split == "train" else "t10k"
        x = _idx(f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 784)
        y = _idx(f"{prefix}-labels-idx1-ubyte.gz", 8).astype(np.int64)
        _cache[split] = (x, y)
    return _cache[split]


def pixels(raw):
    """Bytes to float32 in [0, 1] (the same quotient as rustytorch's x / 255)."""
    return raw.astype(np.float32) / np.float32(255)


def client_indices(c):
    return [splitmix64(SEED + PER_CLIENT * c + j) % 60000 for j in range(PER_CLIENT)]


def local_train(w, b, c):
    x_all, y_all = data("train")
    idx = client_indices(c)
    w, b = w.copy(), b.copy()
    for start in range(0, len(idx), BATCH):
        batch = idx[start:start + BATCH]
        x, y = pixels(x_all[batch]), y_all[batch]
        z = x @ w + b
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(batch)), y] -= 1.0
        p /= np.float32(len(batch))
        w -= np.float32(LR) * (x.T @ p)
        b -= np.float32(LR) * p.sum(axis=0)
    return w, b, len(idx)


def evaluate(w, b):
    raw, y = data("test")
    if "test_x" not in _cache:
        _cache["test_x"] = pixels(raw)
    z = _cache["test_x"] @ w + b
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float((z.argmax(axis=1) == y).mean()), float(-logp[np.arange(len(y)), y].mean())
