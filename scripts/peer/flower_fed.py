#!/usr/bin/env python3
"""The Flower peer of `rtx bench fed` / `rtx fed run` (issue 15): the SAME workload with Flower's
simulation engine (flwr[simulation], Ray backend), outside CI.

Workload, identical to rustytorch's `configs/fed_flower_ref.toml`:
  - logistic regression 784 -> 10 (weights [784, 10] and bias, zero init), softmax cross-entropy
    averaged over the batch, pixels / 255;
  - client c holds Fashion-MNIST training images splitmix64(42 + 8c + j) mod 60000, j = 0..8
    (standard SplitMix64 output: the golden-ratio increment is added to the state first);
  - local training: 1 epoch of SGD, lr 0.1, batch 8, images in j order;
  - FedAvg weighted by sample count (Flower's FedAvg, "num-examples"), K of N clients per round;
  - centralized test accuracy on the 10,000 test images after each round.

Prints one JSON line per round (round, test_acc, test_loss, seconds) and a summary line with the
median seconds per round and peak RSS (getrusage of this process plus its reaped children, and the
peak summed RSS of the whole process tree, Ray workers included, sampled every 0.2 s).

  scripts/peer/setup-flower-venv.sh
  /work/venv-flower/bin/python scripts/peer/flower_fed.py --population 1000 --clients-per-round 1000 --rounds 5
"""

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Ray workers import the workload module by name: they need its folder on their path too.
os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("RTX_DATA_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data"))
from fed_reference import evaluate, local_train  # noqa: E402


def tree_rss_bytes(root_pid):
    """Summed RSS of root_pid and all its descendants (Linux /proc)."""
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(pid))
        except (OSError, ValueError, IndexError):
            pass
    total, stack = 0, [root_pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
        stack.extend(children.get(pid, []))
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--population", type=int, default=1000)
    ap.add_argument("--clients-per-round", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpus", type=float, default=float(os.cpu_count() or 1), help="CPUs Ray may use")
    ap.add_argument("--client-cpus", type=float, default=1.0, help="CPUs per ClientApp (Flower's default 1: one client per core)")
    args = ap.parse_args()
    n, k, rounds = args.population, args.clients_per_round, args.rounds
    if not 0 < k <= n:
        sys.exit(f"clients-per-round {k} must lie in 1..={n}")

    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    import flwr

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        c = int(context.node_config["partition-id"])
        w, b, n_ex = local_train(arrays[0], arrays[1], c)
        content = RecordDict({"arrays": ArrayRecord([w, b]), "metrics": MetricRecord({"num-examples": n_ex})})
        return Message(content=content, reply_to=msg)

    marks = []
    stop = threading.Event()
    peak = [0]

    def sampler():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss_bytes(os.getpid()))
            stop.wait(0.2)

    server_app = ServerApp()

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=k / n,
            fraction_evaluate=0.0,
            min_train_nodes=k,
            min_available_nodes=n,
        )

        def central(round_, arrays):
            now = time.time()
            if round_ > 0:
                w, b = arrays.to_numpy_ndarrays()
                acc, loss = evaluate(w, b)
                seconds = now - marks[-1]
                print(json.dumps({"peer": "flower", "round": round_, "test_acc": round(acc, 4),
                                  "test_loss": round(loss, 4), "seconds": round(seconds, 3)}), flush=True)
                marks.append(time.time())
            else:
                marks.append(now)
            return None

        init = ArrayRecord([np.zeros((784, 10), np.float32), np.zeros(10, np.float32)])
        strategy.start(grid=grid, initial_arrays=init, num_rounds=rounds, evaluate_fn=central)

    threading.Thread(target=sampler, daemon=True).start()
    started = time.time()
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=n,
        backend_config={
            "client_resources": {"num_cpus": args.client_cpus, "num_gpus": 0.0},
            "init_args": {"num_cpus": args.cpus, "include_dashboard": False},
        },
    )
    total = time.time() - started
    stop.set()
    per_round = [marks[i + 1] - marks[i] for i in range(len(marks) - 1)]
    ru_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ru_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps({
        "peer": "flower", "flwr": flwr.__version__, "population": n, "clients_per_round": k, "rounds": rounds,
        "median_s_per_round": round(statistics.median(per_round), 3) if per_round else None,
        "total_s": round(total, 1),
        "peak_rss_tree_mib": round(peak[0] / 2**20, 1),
        "maxrss_self_mib": round(ru_self / 2**20, 1),
        "maxrss_children_mib": round(ru_children / 2**20, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
