"""CPU time of a sweep job's two end-of-run heatmaps: drawn on fresh figures, and on this thread's reused ones.

    python scripts/bench/heatmap.py [--repeats 10]

The records are shaped as a tiny run's (model=tiny max_steps=100: 2 blocks, telemetry at 11 steps), their values
in the ranges of one such run's (about 0.03 to 0.4 and 0.04 to 1.2: log colour scales with labelled minor ticks).
Prints the process CPU seconds per pair of heatmaps, each way, interleaved, and whether the PNGs are the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import normlab.analysis.render.heatmap as heatmap
from normlab import keys


def records(depth: int = 2, steps: int = 11) -> list[dict]:
    out = []
    for s in range(steps):
        record = {"step": 10 * s}
        for i in range(depth):
            label = keys.layer_label(i, depth)
            record[keys.layer_key(keys.RESID_RMS, label)] = 0.028 * (1 + s) ** (0.85 + 0.3 * i)
            record[keys.layer_key(keys.GRAD_NORM, label)] = 1.2 / (1 + s) ** (0.6 + 0.5 * i)
        out.append(record)
    return out


def pair(recs: list[dict], kept: dict | None) -> tuple[float, list[bytes]]:
    """The two heatmaps drawn on the figures `kept` (a worker's, reused from its earlier jobs), or on new ones."""
    pngs, started = [], time.process_time()
    for stat in (keys.RESID_RMS, keys.GRAD_NORM):
        heatmap._figures.by_size = {} if kept is None else kept
        pngs.append(heatmap.layer_heatmap(recs, stat, stat))
    return time.process_time() - started, pngs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    recs = records()
    kept: dict = {}
    pair(recs, kept)  # imports, the font cache, and the worker's first job
    times: dict[str, list[float]] = {"fresh": [], "reused": []}
    same = True
    for _ in range(args.repeats):
        cpu_fresh, fresh = pair(recs, None)
        cpu_reused, reused = pair(recs, kept)
        times["fresh"].append(cpu_fresh)
        times["reused"].append(cpu_reused)
        same &= fresh == reused
    for way, seconds in times.items():
        print(f"{way:7s} {statistics.median(seconds):.3f} s CPU per pair of heatmaps (median of {args.repeats})")
    print(f"same PNG bytes: {same}")


if __name__ == "__main__":
    main()
