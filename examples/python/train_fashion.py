# %% [markdown]
# # Train Fashion-MNIST from Python, plot the loss, read the checkpoint
#
# A notebook-style script (cells marked `# %%`, which Jupyter, VS Code and jupytext open as a
# notebook; `python examples/python/train_fashion.py` runs it top to bottom). It launches an
# elastic data-parallel job on two worker processes, watches it, plots the loss curve with
# matplotlib, then loads the checkpoint as numpy arrays and classifies test images with them,
# in numpy, to show the weights are the trained ones.
#
# Needs: `pip install ./python matplotlib` and the data (`bash scripts/fetch-data.sh`), run from
# the repository root. `RTX_EXAMPLE_STEPS` shortens the run (CI uses 60); `RTX_EXAMPLE_OUT`
# picks the output folder (default: a fresh temporary folder).

# %%
import gzip
import os
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import rustytorch

steps = int(os.environ.get("RTX_EXAMPLE_STEPS", "600"))
out = Path(os.environ.get("RTX_EXAMPLE_OUT") or tempfile.mkdtemp(prefix="rustytorch-example-")) / "run"
data = Path(os.environ.get("RTX_DATA_DIR", "data"))

# %% [markdown]
# ## Launch and watch
# `launch` returns at once; the supervisor runs on a background thread of this process and the
# workers are two `python -m rustytorch._worker` processes.

# %%
job = rustytorch.launch("configs/fashion_mlp.toml", nproc=2, steps=steps, out=out, data_dir=data)
while not job.done():
    s = job.status()
    loss = "-" if s["loss"] is None else f"{s['loss']:.3f}"
    print(f"{s['phase']:>10}: step {s['step']}/{s['total_steps']}, loss {loss}, {s['world']} worker(s)")
    time.sleep(2)
status = job.wait()
print("eval:", status["eval"])
print("events:", [e["event"] for e in job.events() if e["event"] != "committed"])

# %% [markdown]
# ## The loss curve

# %%
curve = np.array(status["loss_curve"])
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(curve[:, 0], curve[:, 1])
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title(f"Fashion-MNIST MLP, {status['world']} workers")
fig.tight_layout()
fig.savefig(out / "loss_from_python.png", dpi=100)
print("plot:", out / "loss_from_python.png")

# %% [markdown]
# ## Read the checkpoint and use it
# The tensors come back as numpy arrays (`as_torch=True` gives torch tensors). The MLP is
# `Linear` layers (`weight` is `[out, in]`) with ReLU between; inputs are normalized pixels.

# %%
checkpoint = rustytorch.latest_checkpoint(out)
params = rustytorch.load_checkpoint(checkpoint)
# The model's parameters are `layers.<i>.weight` / `.bias`; `optim.*` is the AdamW state.
for name, array in params.items():
    if not name.startswith("optim."):
        print(f"{name:>16} {array.dtype} {array.shape}")


def read_idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes())
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


train = read_idx(data / "fashion-mnist/train-images-idx3-ubyte.gz").reshape(-1, 784) / 255.0
images = read_idx(data / "fashion-mnist/t10k-images-idx3-ubyte.gz").reshape(-1, 784)[:2000] / 255.0
labels = read_idx(data / "fashion-mnist/t10k-labels-idx1-ubyte.gz")[:2000]
x = ((images - train.mean()) / train.std()).astype(np.float32)
weights = sorted((n for n in params if n.startswith("layers.") and n.endswith(".weight")), key=lambda n: int(n.split(".")[1]))
for i, name in enumerate(weights):
    x = x @ params[name].T + params[name[: -len("weight")] + "bias"]
    if i < len(weights) - 1:
        x = np.maximum(x, 0)
accuracy = float((x.argmax(axis=1) == labels).mean())
print(f"accuracy of the checkpoint on 2000 test images, computed in numpy: {accuracy:.3f}")
assert accuracy > 0.5, "the checkpoint should classify far better than chance (0.1)"
