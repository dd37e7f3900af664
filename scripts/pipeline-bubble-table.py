#!/usr/bin/env python3
"""Markdown table of `rtx bench pipeline` JSON lines (stdin or files): measured wall-time busy/idle
per stage and bubble next to 1F1B's theory and the two virtual-time predictions (from the run's
per-stage compute; from the calibration's per-layer costs, where the bench printed it). Python
stdlib only.

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
            cut = f"; stages cut {line['partition']}" if "partition" in line else ""
            print(f"Setup: {line['model']}; {line['mesh']}; {line['cores']} cores, {line['ranks']} ranks x "
                  f"{line['threads_per_rank']} kernel threads per rank ({over}); {line['warmup']} warm-up + {line['steps']} timed steps{cut}.")
            if "layer_forward_ms" in line:
                f, b = line["layer_forward_ms"], line["layer_backward_ms"]
                print()
                print(f"Calibration (one micro-batch, ms): embedding {f['embed']:.2f} + {b['embed']:.2f}, blocks (median) "
                      f"{sorted(f['blocks'])[len(f['blocks']) // 2]:.2f} + {sorted(b['blocks'])[len(b['blocks']) // 2]:.2f}, "
                      f"head and loss {f['head']:.2f} + {b['head']:.2f} (forward + backward, beyond a block).")
            print()
            continue
        rows.append(line)
    print("| schedule | m | step (s) | busy per stage (s) | idle per stage (s) | waiting per stage (s) | bubble mean | bubble worst | 1F1B theory | predicted mean | predicted worst | layer-cost predicted mean | layer-cost predicted worst | blocks per virtual stage |")
    print("|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        p = r["predicted"]
        lp = r.get("predicted_layers")
        layer_cols = f"{lp['bubble_mean']:.4f} | {lp['bubble_worst']:.4f}" if lp else "– | –"
        cut = ", ".join(str(int(x.split("..")[1]) - int(x.split("..")[0])) for x in r["layers"]) if "layers" in r else "–"
        print(f"| {r['schedule']} | {r['m']} | {r['step_s']:.3f} | {secs(r['busy_s'])} | {secs(r['idle_s'])} | {secs(r['waiting_s'])} | "
              f"{r['bubble_mean']:.4f} | {r['bubble_worst']:.4f} | {r['theory_1f1b']:.4f} | {p['bubble_mean']:.4f} | {p['bubble_worst']:.4f} | {layer_cols} | {cut} |")


if __name__ == "__main__":
    main()
