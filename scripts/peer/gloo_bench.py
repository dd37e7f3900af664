#!/usr/bin/env python3
"""PyTorch Gloo side of `scripts/bench-collectives.sh`: all_reduce (sum, f32) between processes on
this machine, timed like `rtx bench collectives` (same sizes, world sizes, repeats and formulas).

    gloo_bench.py [--worlds 2,4] [--sizes 4096,1048576,...] [--repeats 5] [--sample-ms 40]
    gloo_bench.py --table RESULTS.jsonl   # rtx and gloo lines of one run: busbw side by side
    gloo_bench.py --netns rtx-h --host-addrs 10.77.0.1,10.77.0.2 --worlds 4   # ranks in namespaces

Each world size spawns that many processes (torch.multiprocessing, TCP store on 127.0.0.1, Gloo over
loopback TCP). For every size, rank 0 times --repeats samples of back-to-back all_reduce calls
(operations per sample from one timed warm-up call, about --sample-ms each, a barrier before each
sample) and prints one JSON line with the median time per call: algbw = bytes / time,
busbw = algbw * 2(n-1)/n (nccl-tests). Each process uses one intra-op thread.
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, sizes, repeats, sample_ms, queue, master="127.0.0.1"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
    for nbytes in sizes:
        buf = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
        # One checked call: every element is the sum of 1..world.
        dist.all_reduce(buf)
        want = world * (world + 1) / 2
        if not bool((buf == want).all()):
            raise RuntimeError(f"rank {rank}: wrong all_reduce result")
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        once = time.perf_counter() - t0
        iters = torch.tensor([max(1, min(20000, int(sample_ms * 1e-3 / max(once, 1e-7))))], dtype=torch.int64)
        dist.broadcast(iters, 0)
        iters = int(iters.item())
        samples = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            samples.append((time.perf_counter() - t0) * 1e6 / iters)
        if rank == 0:
            queue.put((nbytes, iters, samples))
        if rank == 0 and not hasattr(queue, "get"):
            queue.emit(world, nbytes, iters, samples)
    dist.barrier()
    dist.destroy_process_group()


def table(path):
    """Prints all_reduce busbw of rtx (per transport) next to Gloo's, and their ratio, from the
    JSON lines of one run (rtx with algo "auto" only)."""
    rtx, gloo, refs = {}, {}, {}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "reference" in r:
                refs[r["reference"]] = r
            if r.get("op") != "all_reduce":
                continue
            if r.get("impl") == "gloo":
                gloo[(r["world"], r["bytes"])] = r
            elif r.get("algo") == "auto":
                rtx[(r["transport"], r["world"], r["bytes"])] = r
    transports = sorted({t for t, _, _ in rtx})
    cipher = refs.get("tls_cipher")
    print("all_reduce f32, busbw GB/s (median); ratio = rtx / gloo; 4K rows also show time in us")
    head = f"{'n':>2} {'size':>6} {'gloo':>8}" + "".join(f" {t:>8} {t + '/gloo':>10}" for t in transports)
    print(head)
    for (world, nbytes) in sorted(gloo):
        g = gloo[(world, nbytes)]
        row = f"{world:>2} {human(nbytes):>6} {g['busbw_gbps']:>8.3f}"
        for t in transports:
            r = rtx.get((t, world, nbytes))
            if r is None:
                row += f" {'-':>8} {'-':>10}"
            elif nbytes <= 4096:
                row += f" {r['time_us']:>6.0f}us {g['time_us'] / r['time_us']:>9.1f}x"
            else:
                row += f" {r['busbw_gbps']:>8.3f} {r['busbw_gbps'] / g['busbw_gbps']:>10.2f}"
        if nbytes <= 4096:
            row = row.replace(f"{g['busbw_gbps']:>8.3f}", f"{g['time_us']:>6.0f}us", 1)
        print(row)
    quics = [t for t in transports if t.startswith(("quic", "tls"))]
    if cipher and quics:
        # What Gloo could reach if it also had to run the TLS packet cipher on the same cores:
        # each rank seals and opens the busbw bytes it moves (see `rtx bench collectives`).
        print(f"TLS cipher bound (AES-128-GCM as quinn runs it: seal {cipher['seal_gbps']:.2f}, "
              f"open {cipher['open_gbps']:.2f} GB/s on one core; {cipher['cores']} cores)")
        print(f"{'n':>2} {'size':>6} {'gloo':>8} {'gloo+tls':>9}" + "".join(f" {t:>8} {t + '/bound':>12}" for t in quics))
        for (world, nbytes) in sorted(gloo):
            if nbytes <= 4096:
                continue
            g = gloo[(world, nbytes)]["busbw_gbps"]
            share = max(1.0, world / cipher["cores"])
            bound = 1.0 / (1.0 / g + share / cipher["seal_gbps"] + share / cipher["open_gbps"])
            row = f"{world:>2} {human(nbytes):>6} {g:>8.3f} {bound:>9.3f}"
            for t in quics:
                r = rtx.get((t, world, nbytes))
                row += f" {'-':>8} {'-':>12}" if r is None else f" {r['busbw_gbps']:>8.3f} {r['busbw_gbps'] / bound:>12.2f}"
            print(row)
    if "tcp_rtt_64b" in refs:
        print(f"loopback TCP 64 B round trip: {refs['tcp_rtt_64b']['us']:.1f} us; "
              f"for 4K rows the ratio is gloo time / rtx time (higher is better)")


def human(n):
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def result_line(world, nbytes, iters, samples, hosts=1):
    t = statistics.median(samples)
    algbw = nbytes / (t * 1e-6) / 1e9
    busbw = algbw * 2 * (world - 1) / world
    line = {
        "bench": "collectives", "impl": "gloo", "transport": "gloo-tcp", "world": world, "op": "all_reduce", "bytes": nbytes,
        "time_us": round(t, 3), "min_us": round(min(samples), 3), "max_us": round(max(samples), 3), "repeats": len(samples),
        "iters": iters, "algbw_gbps": round(algbw, 3), "busbw_gbps": round(busbw, 3),
    }
    if hosts > 1:
        line["hosts"] = hosts
    return json.dumps(line)


class Printer:
    """Rank 0's report in the namespaced mode: one JSON line per size on stdout."""

    def __init__(self, hosts):
        self.hosts = hosts

    def put(self, item):
        pass

    def emit(self, world, nbytes, iters, samples):
        print(result_line(world, nbytes, iters, samples, self.hosts), flush=True)


def netns_run(args, sizes):
    """One process per rank, host h's ranks inside network namespace PREFIX{h} (`ip netns exec`),
    Gloo over TCP between the hosts' addresses, the store on host 0's address."""
    import subprocess
    import sys
    addrs = [a for a in args.host_addrs.split(",") if a]
    hosts = len(addrs)
    for world in [int(w) for w in args.worlds.split(",") if w]:
        procs = []
        for rank in range(world):
            host = rank * hosts // world
            cmd = ["ip", "netns", "exec", f"{args.netns}{host}", sys.executable, __file__, "--rank", str(rank), "--world", str(world),
                   "--master", addrs[0], "--port", str(args.port), "--hosts", str(hosts), "--sizes", args.sizes,
                   "--repeats", str(args.repeats), "--sample-ms", str(args.sample_ms)]
            env = dict(os.environ, GLOO_SOCKET_IFNAME=args.ifname)
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
        for line in procs[0].stdout:
            sys.stdout.write(line.decode())
            sys.stdout.flush()
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"gloo rank exited with {p.returncode}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", metavar="JSONL", help="print the comparison table of a finished run and exit")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--sizes", default=",".join(str(4096 * 4**i) for i in range(9)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample-ms", type=float, default=40)
    ap.add_argument("--netns", metavar="PREFIX", help="run host h's ranks in network namespace PREFIX{h} (with --host-addrs)")
    ap.add_argument("--host-addrs", default="", help="the hosts' addresses inside their namespaces, one per host")
    ap.add_argument("--ifname", default="eth0", help="the interface Gloo uses inside the namespaces")
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        table(args.table)
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, sizes, args.repeats, args.sample_ms, Printer(args.hosts), args.master)
        return
    if args.netns:
        netns_run(args, sizes)
        return
    ctx = mp.get_context("spawn")
    for world in [int(w) for w in args.worlds.split(",") if w]:
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, sizes, args.repeats, args.sample_ms, queue)) for r in range(world)]
        for p in procs:
            p.start()
        for _ in sizes:
            nbytes, iters, samples = queue.get()
            print(result_line(world, nbytes, iters, samples), flush=True)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"gloo rank exited with {p.exitcode}")


if __name__ == "__main__":
    main()
