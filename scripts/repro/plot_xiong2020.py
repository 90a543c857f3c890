"""Xiong et al. 2020's pictures from normlab run dirs: prints the numbers and writes two PNGs.

xiong2020_grad_init.png   the paper's Figure 3: the norm of the FFN's parameter gradient
                          (telemetry's step-0 grad/norm/LXX/mlp) against layer index at
                          initialization, Post-LN and Pre-LN, mean and min-max over the runs
                          (seeds) found under --init
xiong2020_warmup.png      training loss against step for the runs under the --runs dirs, a
                          panel per peak lr, Pre-LN and Post-LN with and without warmup

usage: python scripts/repro/plot_xiong2020.py --init SWEEP_DIR [--runs SWEEP_DIR...] --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

MLP_GRAD = re.compile(r"^grad/norm/L(\d+)/mlp$")
COLOURS = {"post": "tab:red", "pre": "tab:blue"}
NAMES = {"post": "Post-LN", "pre": "Pre-LN"}


def run_dirs(root: Path) -> list[Path]:
    """Every run dir (a dir holding summary.json) under `root`, skipping wandb's dirs."""
    return sorted(p.parent for p in root.rglob("summary.json") if "wandb" not in p.parts)


def read_rows(run: Path) -> list[dict]:
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut off by a kill
    return rows


def config(run: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(run / ".hydra" / "config.yaml"))


def init_mlp_grads(root: Path) -> dict[str, np.ndarray]:
    """Per placement, an array (runs × layers) of step 0's grad/norm/LXX/mlp."""
    grads: dict[str, list[list[float]]] = defaultdict(list)
    for run in run_dirs(root):
        step0 = next((r for r in read_rows(run) if r.get("step") == 0 and any(MLP_GRAD.match(k) for k in r)), None)
        if step0 is None:
            continue
        layers = sorted((int(m.group(1)), v) for k, v in step0.items() if (m := MLP_GRAD.match(k)))
        grads[config(run)["placement"]].append([v for _, v in layers])
    return {placement: np.array(rows) for placement, rows in grads.items()}


def plot_grad_init(grads: dict[str, np.ndarray], depth_label: str, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for placement in ("post", "pre"):
        if placement not in grads:
            continue
        g = grads[placement]
        layers = np.arange(1, g.shape[1] + 1)
        mean = g.mean(axis=0)
        ax.plot(layers, mean, "o-", color=COLOURS[placement], label=f"{NAMES[placement]} (mean of {len(g)} seeds)")
        ax.fill_between(layers, g.min(axis=0), g.max(axis=0), color=COLOURS[placement], alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("layer index (1 = next to the input)")
    ax.set_ylabel("‖∂loss/∂ FFN parameters‖ at init")
    ax.set_title(f"Gradient of the FFN at initialization ({depth_label})", fontsize=10)
    ax.set_xticks(np.arange(1, max(g.shape[1] for g in grads.values()) + 1))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def training_runs(root: Path) -> list[dict]:
    runs = []
    for run in run_dirs(root):
        cfg = config(run)
        summary = json.loads((run / "summary.json").read_text())
        rows = [r for r in read_rows(run) if "loss" in r]
        runs.append(
            {
                "placement": cfg["placement"],
                "lr": cfg["lr"],
                "warmup": cfg["optim"]["warmup_steps"],
                "steps": [r["step"] for r in rows],
                "loss": [r["loss"] for r in rows],
                "summary": summary,
            }
        )
    return sorted(runs, key=lambda r: (r["lr"], r["placement"], r["warmup"]))


def plot_warmup(runs: list[dict], out: Path) -> None:
    lrs = sorted({r["lr"] for r in runs})
    fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 3.8), sharey=True, squeeze=False)
    for ax, lr in zip(axes[0], lrs):
        for r in (r for r in runs if r["lr"] == lr):
            style = "-" if r["warmup"] else "--"
            label = f"{NAMES[r['placement']]}, " + (f"warmup {r['warmup']}" if r["warmup"] else "no warmup")
            ax.plot(r["steps"], r["loss"], style, color=COLOURS[r["placement"]], label=label)
        ax.set_title(f"peak lr {lr:g}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("training loss (nats/byte)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", type=Path, required=True, help="sweep dir of the step-0 (seed) runs")
    parser.add_argument("--runs", type=Path, nargs="+", default=[], help="sweep dirs of the training runs (warmup on/off)")
    parser.add_argument("--out", type=Path, required=True, help="dir for the PNGs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    grads = init_mlp_grads(args.init)
    if not grads:
        raise SystemExit(f"plot_xiong2020: no step-0 grad/norm/LXX/mlp telemetry under {args.init}")
    depth = max(g.shape[1] for g in grads.values())
    print(f"step-0 FFN gradient norm by layer (mean over seeds; min-max), {args.init}")
    for placement, g in sorted(grads.items()):
        mean = g.mean(axis=0)
        cells = "  ".join(f"L{i + 1}:{m:.3g}" for i, m in enumerate(mean))
        print(f"  {NAMES.get(placement, placement)} ({len(g)} seeds): {cells}")
        print(f"    last/first layer: {mean[-1] / mean[0]:.2f}; per-seed last/first min {min(g[:, -1] / g[:, 0]):.2f}"
              f" max {max(g[:, -1] / g[:, 0]):.2f}")
    if "post" in grads and "pre" in grads:
        ratio = grads["post"].mean(axis=0)[-1] / grads["pre"].mean(axis=0)[-1]
        print(f"  last layer, Post-LN / Pre-LN: {ratio:.2f}")
    plot_grad_init(grads, f"{depth} blocks", args.out / "xiong2020_grad_init.png")

    if args.runs:
        runs = sorted((r for root in args.runs for r in training_runs(root)), key=lambda r: (r["lr"], r["placement"], r["warmup"]))
        print(f"training runs, {' '.join(map(str, args.runs))}")
        print("  placement  lr      warmup  status     final val loss  best val loss")
        for r in runs:
            s = r["summary"]
            final = s.get("final_val_loss")
            best = s.get("best_val_loss")
            print(f"  {r['placement']:<9}  {r['lr']:<6g}  {r['warmup']:<6}  {s.get('status', '?'):<9}  "
                  f"{final if final is None else format(final, '.3f'):>14}  {best if best is None else format(best, '.3f'):>13}")
        plot_warmup(runs, args.out / "xiong2020_warmup.png")
    print(f"figures: {args.out}")


if __name__ == "__main__":
    main()
