"""normlab's real training loop beside a hand-written reference loop on one CUDA GPU, in one process.

    python scripts/bench/step_speed_gpu.py [--shapes medium,gpt2] [--rounds 2] [--windows 10] [--every 10]
                                [--precision bf16] [--only NAME,...] [--aa] [--json FILE] [--peak-size 8192]
                                [--deterministic] [--cpu]

Shapes: `medium` (the medium preset: 8 blocks, width 256, seq 128, batch 32) and `gpt2` (GPT-2
small's shape: 12 blocks, width 768, 12 heads, seq 1024, batch 32; byte vocabulary). For each, the
variants run interleaved, round after round, in this one process:

- `ref eager`, `ref compile`, `ref cudagraph`: the reference, a minimal GPT (scripts/bench/step_speed.py's
  RefGPT: pre-LN, tied head, SDPA, GELU MLP) trained by the loop written here, as nanoGPT's train.py
  trains: bf16 autocast, fused AdamW, clipping at 1.0, pinned non-blocking batch copies, a host sync
  every `--every` steps; compiled with torch.compile, and with mode="reduce-overhead" (CUDA graphs).
- `normlab eager|compile|cudagraph`, each with telemetry off and at `telemetry.every=--every`: a real
  `normlab.train.run.train` run (compile=true, compile_mode=reduce-overhead for cudagraph), logging every
  `--every` steps, so each timed window holds one telemetry step when telemetry is on.
- with `--deterministic`, also `normlab eager|compile deterministic`: the same runs with
  deterministic=true (torch's deterministic kernels, cuBLAS's fixed workspace), so their cost is
  printed beside the default. CUBLAS_WORKSPACE_CONFIG is then set for the whole process before its
  first matmul, as cuBLAS reads it once; every other variant runs under it too.
- with `--aa`, also `normlab eager|compile|cudagraph again`: the same run as the one without `again`, timed a
  second time in each round, so that telemetry's and deterministic=true's costs are printed beside the
  difference between two copies of one variant (the A/A control: the noise floor of the comparison).

A window is `--every` steps, timed on the device's clock (CUDA events; scripts/bench/windows.py); each run's
first window (warm-up, compilation, graph capture) is not timed, and every figure is the median over all timed
windows of all rounds (`--rounds` x `--windows`: 20 by default), printed with its interquartile range. Printed:
ms/step, tokens/s, MFU against the bf16 matmul peak measured here (an n×n @ n×n matmul, --peak-size)
and against the device's dense bf16 spec (normlab.nn.flops.PEAK_TFLOPS), peak memory
(torch.cuda.max_memory_allocated), and the ratio of tokens/s to the reference with the same capture.
`--json FILE` also writes each variant's per-window seconds. Without a CUDA device it prints one line and exits 0.
`--cpu` runs it all on the CPU instead (perf_counter for a clock), where its figures mean nothing: a check of the
script itself (tests/test_scripts.py), with the `tiny` shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from windows import DeviceClock, StepMarks, again, spread, variant_of  # noqa: E402

SHAPES = {
    "tiny": ["model=tiny"],  # for --cpu, the script's own check
    "medium": ["model=medium"],
    "gpt2": ["depth=12", "model.d_model=768", "model.n_head=12", "model.context=1024", "seq_len=1024"],
}
CAPTURES = {"eager": (False, "default"), "compile": (True, "default"), "cudagraph": (True, "reduce-overhead")}


def variant_names(every: int, deterministic: bool = False, aa: bool = False) -> list[str]:
    names = [f"ref {capture}" for capture in CAPTURES]
    for capture in CAPTURES:
        names += [f"normlab {capture}", *([again(f"normlab {capture}")] if aa else []), f"normlab {capture} telemetry/{every}"]
        if deterministic and capture != "cudagraph":
            names.append(f"normlab {capture} deterministic")
    return names


def reference_step_times(cfg, every: int, windows: int, device: torch.device, capture: str) -> list[float]:
    """Seconds per step of each timed window of the reference loop, on the device's clock (the first window is
    warm-up)."""
    import step_speed
    from normlab.data import load_corpus, sample_batch
    from normlab.train.optim import lr_at

    torch.manual_seed(cfg.seed)
    model = step_speed.reference_gpt(cfg).to(device)
    compiled, mode = CAPTURES[capture]
    forward: Callable = model
    if compiled:
        fast = torch.compile(model, mode=None if mode == "default" else mode)

        def forward(x):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            return fast(x)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=cfg.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, fused=device.type == "cuda",
    )
    tokens = load_corpus(cfg.data, cfg.tokenizer).train
    gen = torch.Generator().manual_seed(cfg.seed)
    clock = DeviceClock(device)
    clock.mark()
    for step in range(every * (windows + 1)):
        x, y = sample_batch(tokens, cfg.batch_size, cfg.seq_len, gen)
        if device.type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            logits = forward(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % every == 0:
            loss.item()  # the host sync of a loop that logs
            clock.mark()
    return [seconds / every for seconds in clock.seconds()[1:]]


def normlab_step_times(cfg, windows: int, device: torch.device) -> list[float]:
    """Seconds per step of each timed window of a real train() run, on the device's clock: a window is the
    log_every steps up to a logged step (a telemetry step, when telemetry.every = log_every); the first is warm-up,
    and the run's last step (logged, a telemetry step) and its final evaluation fall outside the windows."""
    import step_speed
    from normlab.train.run import train
    from normlab.train.sinks import MetricsFile, RunDir

    k = cfg.log_every
    cfg.max_steps, cfg.eval_every = step_speed.normlab_max_steps(k, windows), 0
    clock = DeviceClock(device)
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, run_dir, sinks=[MetricsFile(RunDir(run_dir))], callbacks=[StepMarks(clock, k)])
    return [seconds / k for seconds in clock.seconds()[1:windows + 1]]


def run_variant(name: str, overrides: list[str], args, device: torch.device) -> dict[str, Any]:
    import step_speed

    loop, capture, *extras = variant_of(name).split(" ")
    compiled, mode = CAPTURES[capture]
    telemetry = any(extra.startswith("telemetry") for extra in extras)
    deterministic = "deterministic" in extras
    cfg = step_speed.compose([*overrides, f"device={device.type}", f"precision={args.precision}", f"log_every={args.every}",
                         f"compile={str(compiled).lower()}", f"compile_mode={mode}", "progress=false",
                         f"telemetry.every={args.every if telemetry else 0}", "ckpt.every=0", "wandb.mode=disabled",
                         f"deterministic={str(deterministic).lower()}"])
    torch.use_deterministic_algorithms(False)  # a deterministic run before leaves it on; train() sets its own
    torch._dynamo.reset()
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if loop == "ref":
        step_s = reference_step_times(cfg, args.every, args.windows, device, capture)
    else:
        step_s = normlab_step_times(cfg, args.windows, device)
    return {"step_s": step_s, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if gpu else 0.0, "cfg": cfg}


def report(shape: str, results: dict[str, dict[str, Any]], measured_peak: float, spec_peak: float | None) -> None:
    from normlab.nn.flops import model_flops_per_token

    cfg = next(iter(results.values()))["cfg"]
    flops = model_flops_per_token(cfg)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    print(f"\n{shape}: {cfg.depth} blocks, width {cfg.model.d_model}, {cfg.model.n_head} heads, seq {cfg.seq_len}, "
          f"batch {cfg.batch_size}, {cfg.precision}; model FLOPs/token {flops / 1e6:.1f} M; medians over the timed "
          "windows, with their interquartile range")
    print(f"{'variant':<34}{'ms/step':>9}{'IQR ms':>16}{'windows':>8}{'tokens/s':>12}{'MFU meas':>10}{'MFU spec':>10}"
          f"{'peak GiB':>10}{'vs ref':>8}")
    spreads = {n: spread(r["step_s"]) for n, r in results.items() if r["step_s"]}
    medians = {n: s["median"] for n, s in spreads.items()}
    for name, s in spreads.items():
        tok_s = tokens_per_step / s["median"]
        spec = f"{100 * tok_s * flops / spec_peak:>9.1f}%" if spec_peak else f"{'n/a':>10}"
        ref = medians.get("ref " + name.split(" ")[1])
        vs_ref = f"{ref / s['median']:>8.3f}" if ref and not name.startswith("ref") else f"{'':>8}"
        iqr = f"{1e3 * s['q1']:.2f}-{1e3 * s['q3']:.2f}"
        print(f"{name:<34}{1e3 * s['median']:>9.2f}{iqr:>16}{s['windows']:>8}{tok_s:>12.0f}"
              f"{100 * tok_s * flops / measured_peak:>9.1f}%{spec}{results[name]['peak_gib']:>10.2f}{vs_ref}")
    for name in medians:
        base = " ".join(name.split(" ")[:2])
        control = medians.get(again(base))
        aa = f" (A/A: {100 * (control / medians[base] - 1):+.1f}%)" if control and base in medians else ""
        if "telemetry" in name and base in medians:
            print(f"  telemetry overhead, {name}: {100 * (medians[name] / medians[base] - 1):+.1f}%{aa}")
        if "deterministic" in name and base in medians:
            print(f"  deterministic=true costs, {name}: {100 * (medians[name] / medians[base] - 1):+.1f}% per step{aa}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="medium,gpt2", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the interleaved variants")
    parser.add_argument("--windows", type=int, default=10, help="timed windows per run, after one warm-up window")
    parser.add_argument("--every", type=int, default=10, help="steps per window: log and telemetry interval")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--only", default=None, help="comma-separated variant names to run")
    parser.add_argument("--peak-size", type=int, default=8192, help="side n of the n×n @ n×n bf16 matmul timed")
    parser.add_argument("--deterministic", action="store_true", help="also time normlab with deterministic=true")
    parser.add_argument("--aa", action="store_true", help="also time each normlab variant's plain run a second time "
                                                           "(the A/A control)")
    parser.add_argument("--json", type=Path, default=None, help="write each variant's per-window seconds here")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU: a check of the script, not a measurement")
    args = parser.parse_args()
    if not (args.cpu or torch.cuda.is_available()):
        print("step_speed_gpu.py: no CUDA device: nothing to measure")
        return 0
    if args.deterministic:
        from normlab.train.runtime import CUBLAS_DETERMINISTIC

        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]  # before the first matmul: read once
        print(f"--deterministic: CUBLAS_WORKSPACE_CONFIG={CUBLAS_DETERMINISTIC[0]} for every variant, so the cost "
              "printed for deterministic=true leaves out that of the workspace setting")

    import step_speed
    from normlab.nn.flops import peak_flops

    device = torch.device("cpu" if args.cpu else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    measured_peak = step_speed.peak_matmul_flops(torch.bfloat16, device, args.peak_size)
    spec_peak = peak_flops(device, "bf16", tf32=True)
    device_name = "CPU (a check of this script: its figures mean nothing)" if args.cpu else torch.cuda.get_device_name(device)
    print(f"{device_name}: bf16 matmul peak measured {measured_peak / 1e12:.1f} TFLOP/s "
          f"({args.peak_size}² @ {args.peak_size}²), spec " + (f"{spec_peak / 1e12:.1f}" if spec_peak else "unknown"))
    names = [n for n in variant_names(args.every, args.deterministic, args.aa)
             if args.only is None or n in args.only.split(",")]
    raw: dict[str, dict[str, list[float]]] = {}
    for shape in args.shapes.split(","):
        results: dict[str, dict[str, Any]] = {}
        for r in range(args.rounds):
            for name in names:
                out = run_variant(name, SHAPES[shape], args, device)
                entry = results.setdefault(name, {"step_s": [], "peak_gib": 0.0, "cfg": out["cfg"]})
                entry["step_s"] += out["step_s"]
                entry["peak_gib"] = max(entry["peak_gib"], out["peak_gib"])
            print(f"{shape}: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        report(shape, results, measured_peak, spec_peak)
        raw[shape] = {name: r["step_s"] for name, r in results.items()}
    if args.json:
        clock = "cuda events" if device.type == "cuda" else "perf_counter"
        args.json.write_text(json.dumps({"device": device_name, "clock": clock, "seconds_per_step": raw}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
