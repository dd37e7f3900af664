#!/usr/bin/env python3
"""Markdown table of `rtx bench pipeline` JSON lines (stdin or files): measured wall-time busy/idle
per stage and bubble next to 1F1B's theory and the virtual-time prediction. Python stdlib only.

    rtx bench pipeline | tee pipeline.jsonl; python3 scripts/pipeline-bubble-table.py pipeline.jsonl
"""
import fileinput
import json


def secs(xs):
    return ", ".join(f"{x:.3f}" for x in xs)


def main():
    rows = []
    for raw in fileinput.input():
        raw = raw.strip()
        if not raw.startswith("{"):
            continue
        line = json.loads(raw)
        if line.get("bench") != "pipeline":
            continue
        if line.get("line") == "setup":
            over = "oversubscribed" if line["oversubscribed"] else "not oversubscribed"
            print(f"Setup: {line['model']}; {line['mesh']}; {line['cores']} cores, {line['ranks']} ranks x "
                  f"{line['threads_per_rank']} kernel threads per rank ({over}); {line['warmup']} warm-up + {line['steps']} timed steps.")
            print()
            continue
        rows.append(line)
    print("| schedule | m | step (s) | busy per stage (s) | idle per stage (s) | waiting per stage (s) | bubble mean | bubble worst | 1F1B theory | predicted mean | predicted worst |")
    print("|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        p = r["predicted"]
        print(f"| {r['schedule']} | {r['m']} | {r['step_s']:.3f} | {secs(r['busy_s'])} | {secs(r['idle_s'])} | {secs(r['waiting_s'])} | "
              f"{r['bubble_mean']:.4f} | {r['bubble_worst']:.4f} | {r['theory_1f1b']:.4f} | {p['bubble_mean']:.4f} | {p['bubble_worst']:.4f} |")


if __name__ == "__main__":
    main()
