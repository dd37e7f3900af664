"""Peer for scripts/bench-recovery.sh: the same job shape under torchrun's elastic restart.

An MLP 784-128-10 with AdamW, global batch 64 split over the ranks, DDP over gloo, checkpointing
every CKPT_EVERY steps (rank 0, atomic rename). Data are random tensors drawn per (step, rank):
recovery time does not depend on what the pixels are. Rank 0 appends one JSON line per step
(step, wall time, restart count) to OUT/steps.jsonl; every rank writes its pid to OUT/pid-<rank>.
Run under: torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d ...
"""
import json, os, time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out = os.environ["OUT"]
steps = int(os.environ.get("STEPS", "3000"))
ckpt_every = int(os.environ.get("CKPT_EVERY", "100"))
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(os.path.join(out, f"pid-{rank}"), "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
ddp = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
ckpt = os.path.join(out, "ckpt.pt")
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"] + 1
log = open(os.path.join(out, "steps.jsonl"), "a") if rank == 0 else None
rows = 64 // world
for step in range(start, steps):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(rows, 784, generator=g)
    y = torch.randint(0, 10, (rows,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    if log:
        log.write(json.dumps({"step": step, "t": time.time(), "restart": restart}) + "\n")
        log.flush()
        if step % ckpt_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
dist.destroy_process_group()
