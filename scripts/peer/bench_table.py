#!/usr/bin/env python3
"""Markdown tables from the JSON lines of `rtx bench` and `torch_bench.py` (bench-vs-torch.sh).

    bench_table.py RESULTS.jsonl [MORE.jsonl ...]

Medians over rounds of each side's per-run median; ratio = rustytorch / torch time (lower is
better). Ops rows give forward+backward per call and the per-step total (x count).
"""
import json
import statistics
import sys


def main(paths):
    rows = [json.loads(l) for p in paths for l in open(p) if l.strip()]
    groups = {}
    for r in rows:
        if r["bench"] == "ops":
            key = ("ops", r["model"], r["op"], r["count"])
            value = r["fwd_bwd_ms"]
        else:
            key = (r["bench"], r.get("shape"), r.get("variant", "step"))
            value = r["median_ms"]
        groups.setdefault(key, {}).setdefault(r["impl"], []).append(value)
    threads = sorted({r["threads"] for r in rows})
    print(f"threads: {', '.join(map(str, threads))}; rounds: {max(len(v) for by in groups.values() for v in by.values())}")
    print()
    print("| benchmark | variant | rustytorch ms | torch ms | ratio rustytorch/torch |")
    print("|---|---|---:|---:|---:|")
    for key, by in groups.items():
        if key[0] == "ops" or "rustytorch" not in by or "torch" not in by:
            continue
        bench, shape, variant = key
        a, b = statistics.median(by["rustytorch"]), statistics.median(by["torch"])
        if bench == "matmul":
            m, n, k = (int(x) for x in shape.split("x"))
            gf = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e9
            print(f"| matmul {shape} | {variant} | {a:.2f} ({gf(a):.0f} GFLOP/s) | {b:.2f} ({gf(b):.0f} GFLOP/s) | {a / b:.2f} |")
        else:
            print(f"| step {shape} | full step | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    ops = [(k, by) for k, by in groups.items() if k[0] == "ops" and "rustytorch" in by and "torch" in by]
    if ops:
        print()
        print("Per op, alone at its shape in the step (forward + backward, medians; count = calls per step):")
        print()
        print("| model | op | count | rustytorch ms | torch ms | ratio | rustytorch ms × count | torch ms × count |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for (_, model, op, count), by in ops:
            a, b = statistics.median(by["rustytorch"]), statistics.median(by["torch"])
            print(f"| {model} | {op} | {count} | {a:.3f} | {b:.3f} | {a / b:.2f} | {a * count:.1f} | {b * count:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
