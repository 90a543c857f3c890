"""Smoke tests of scripts/: each benchmark or measurement script runs one tiny round end to end, as __main__ in
this process, and the normlab commands it starts run here too (tests/inprocess.py: each process would import
torch, Hydra and matplotlib again, 5 to 10 s of CPU), step_speed.py's variants too (a fresh process each, when
measuring: their figures are not asserted here). The exception: startup.py, which times processes, runs its
commands as real processes.

The scripts rebuild parts of the training loop (step_speed.py's window clock and reference loop, the
checkpoint components, the sweep's summaries), so a change to normlab that breaks them should fail
here. Each test asserts the script's table holds computed figures, not only that it exited 0.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inprocess import Commands
from normlab.config import NORMS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# The smallest config the scripts' Hydra overrides can ask for: a 2-block, 32-wide model, 4 × 16 tokens.
TINY = ["model=tiny", "batch_size=4", "seq_len=16", "eval_batches=1", "device=cpu"]
NUMBER = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


def script(name: str, *args: str, cwd: Path) -> str:
    """Run scripts/`name` with `args` in `cwd`; assert it exits 0 and return its stdout."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "WANDB_MODE": "disabled"},
        timeout=600,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture
def commands(monkeypatch):
    return Commands(monkeypatch)


@pytest.fixture
def script_here(commands):
    """script_here(name, *args, cwd=...): scripts/`name` run as `python scripts/name args` runs it (as __main__,
    scripts/ first on sys.path), but in this process (tests/inprocess.py): a fresh Python would import torch
    again, about 2 s of CPU each. A normlab command the script starts needs commands.intercept() to run here too."""

    def run(name: str, *args: str, cwd: Path) -> str:
        result = commands.run([sys.executable, SCRIPTS / name, *args], cwd, {**os.environ, "WANDB_MODE": "disabled"})
        assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        return result.stdout

    return run


def row(out: str, label: str, columns: int) -> list[float]:
    """The first `columns` numbers of the table row that starts with `label` (then two or more spaces)."""
    line = next((l for l in out.splitlines() if re.match(rf"\s*{re.escape(label)}\s{{2,}}", l)), None)
    assert line is not None, f"no row {label!r} in:\n{out}"
    numbers = [float(n) for n in re.findall(NUMBER, line[line.index(label) + len(label):])]
    assert len(numbers) >= columns, line
    return numbers[:columns]


def test_bench_compares_normlab_with_the_reference_loop(tmp_path, commands, script_here):
    commands.intercept(scripts=True)  # its variants (`python step_speed.py --worker SPEC`, a process each) run here too
    out = script_here("bench/step_speed.py", *TINY, "log_every=2", "--rounds", "1", "--windows", "1", "--threads", "1",
                 "--peak-size", "64", "--only", "ref fp32,normlab fp32", cwd=tmp_path)
    assert "model: 2 blocks, width 32, 2 heads, seq 16, batch 4" in out  # the overrides reached the config
    assert "peak matmul (64² @ 64²" in out
    ref_ms, ref_tokens = row(out, "ref fp32", 2)
    ms, tokens, _, _, _, vs_ref = row(out, "normlab fp32", 6)
    assert ref_ms > 0 and ms > 0
    # tokens/s is the step time's inverse, to within the step time's printed rounding (0.05 ms of a few ms)
    assert tokens == pytest.approx(4 * 16 / (ms / 1e3), rel=0.01 + 0.05 / ms)
    assert vs_ref == pytest.approx(ref_ms / ms, rel=0.05)
    (save_us,) = row(out, "checkpoint save / ckpt.every=100", 1)
    assert save_us > 0


def test_bench_inprocess_times_the_three_loops(tmp_path, script_here):
    out = script_here("bench/step_speed_inprocess.py", *TINY, "log_every=2", "--rounds", "1", "--windows", "1", cwd=tmp_path)
    assert "1 rounds x 1 windows" in out
    assert row(out, "ref", 2)[1] == 1.0  # ref / ref
    for loop in ("ref loop, normlab GPT", "normlab"):
        ms, ratio = row(out, loop, 2)
        assert ms > 0 and ratio > 0


def test_bench_telemetry_times_the_three_intervals_and_counts_a_telemetry_steps_ops(tmp_path, script_here):
    out = script_here("bench/telemetry_cost.py", "--rounds", "1", "--windows", "1", "--every", "2", "--threads", "1",
                 "--batch", "2", "--seq", "16", "--isolated", "2", "--processes", "1", "--ops", "--ops-batch", "2",
                 "--ops-seq", "8", cwd=tmp_path)
    assert "batch 2 x seq 16" in out and "1 rounds x 1 windows of 2 steps" in out
    assert re.search(r"telemetry\s+wall/step\s+overhead\s+cpu/step\s+overhead", out)
    assert row(out, "off", 4)[1] == 0.0  # the baseline's overhead over itself
    for variant in ("every 2 (default)", "every step"):
        wall, _, cpu, _ = row(out, variant, 4)
        assert wall > 0 and cpu > 0
    isolated = re.search(rf"this tree +process 1: step min ({NUMBER}) ms, watched step min ({NUMBER}) ms", out)
    assert isolated and 0 < float(isolated.group(1)) and 0 < float(isolated.group(2))
    for shape in ("medium preset (8 blocks x 256, batch 2 x seq 8)", "GPT-2 small's shape (12 blocks x 768, batch 2 x seq 8)"):
        assert f"aten ops per training step, {shape}" in out
    plain, watched, added, ratio = row(out, "this tree", 4)
    assert 0 < plain < watched and added == watched - plain and ratio == pytest.approx(added / plain, abs=1e-3)


def test_telemetry_profile_profiles_a_telemetry_step_beside_a_plain_one(tmp_path, script_here):
    out = script_here("bench/telemetry_profile.py", "--cpu", "--shape", "tiny", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert "step 9 (plain) and step 10 (telemetry), cpu" in out
    figures = {}
    for step in ("plain", "telemetry"):
        line = next(line for line in out.splitlines() if line.startswith(step + " "))
        figures[step] = [float(n) for n in re.findall(NUMBER, line)]
    assert 0 < figures["plain"][1] < figures["telemetry"][1]  # aten ops: the telemetry step's statistics
    report = (tmp_path / "out" / "telemetry-profile-tiny-eager.txt").read_text()
    assert report.startswith("tiny (model=tiny") and report.strip() in out


def test_telemetry_host_splits_what_a_telemetry_step_adds_by_phase(tmp_path, script_here):
    out = script_here("bench/telemetry_host.py", "--pairs", "2", "--processes", "1", "--sinks", "jsonl", "--ops", "--calls",
                      cwd=tmp_path)
    assert "(8 blocks, 8 heads) at width 16, batch 8 x seq 16, cpu bf16, eager, 1 torch thread, sinks jsonl" in out
    line = next(line for line in out.splitlines() if line.startswith("this tree "))
    cells = [(float(w), float(c), int(o), int(n))
             for w, c, o, n in re.findall(r"(-?\d+\.\d+)/(-?\d+\.\d+)/(-?\d+)/(-?\d+)", line)]
    assert len(cells) == 5  # statistics, row, other, sinks, total: (wall ms, CPU ms, aten ops, calls)
    statistics, row_, other, sinks, total = cells
    assert statistics[2] > 0 and row_[2] > 0  # the Probe's ops, its transfer's
    assert other[2] == 0 and sinks[2] == 0  # writing a row to metrics.jsonl dispatches no op
    assert total[2] == statistics[2] + row_[2] and row_[1] > 0
    assert statistics[3] > 1000 and row_[3] > 100 and sinks[3] > 0  # the host's calls: the statistics', naming the row's
    assert int(re.search(r"\((\d+) keys a row\)", line).group(1)) > 200


def test_checkpoint_cost_saves_and_restores_the_tiny_model(tmp_path, script_here):
    out = script_here("bench/checkpoint.py", "tiny", "2", cwd=tmp_path)
    assert "model=tiny depth=2 d_model=32" in out
    size = float(re.search(rf"checkpoint size: {NUMBER} MiB", out).group(1))
    save = float(re.search(rf"save \(write, fsync, rename\): median {NUMBER} ms over 2", out).group(1))
    load = float(re.search(rf"load \+ restore: median {NUMBER} ms over 2", out).group(1))
    assert size > 0 and save > 0 and load > 0


def test_heatmap_cost_times_fresh_and_reused_figures_and_finds_the_same_pngs(tmp_path, script_here):
    out = script_here("bench/heatmap.py", "--repeats", "1", cwd=tmp_path)
    fresh, reused = row(out, "fresh", 1)[0], row(out, "reused", 1)[0]
    assert 0 < fresh < 10 and 0 < reused < 10
    assert "same PNG bytes: True" in out


def test_future_leak_finds_batchnorm_the_only_leak(tmp_path, script_here):
    out = script_here("repro/future_leak.py", "--batch", "2", "--seq", "16", "--t", "7", cwd=tmp_path)
    assert "batch 2 × 16, tokens after t=7 changed" in out
    train_leak, eval_leak, scale = row(out, "batch", 3)
    assert train_leak > 0 and eval_leak == 0 and scale > 0  # batch statistics mix positions in training mode
    for label in [n for n in NORMS if n != "batch"] + ["batch_causal"]:
        assert row(out, label, 2) == [0.0, 0.0], label


def test_norm_throughput_times_every_norm(tmp_path, script_here):
    out = script_here("bench/norm_throughput.py", "--steps", "1", "--batch", "2", "--seq", "16", cwd=tmp_path)
    assert "batch 2 × 16" in out
    for label in [*NORMS, "batch_causal"]:
        (tokens_per_s,) = row(out, label, 1)
        assert tokens_per_s > 0


def test_startup_times_help_and_a_sweep(tmp_path):
    out = script("bench/startup.py", "--jobs", "2", "--steps", "2", "--repeats", "1", *TINY[1:],
                 "wandb.mode=disabled", "telemetry.every=0", cwd=tmp_path)
    for command in ("normlab --help", "normlab train --help"):
        assert float(re.search(rf"{command}\s+{NUMBER} s", out).group(1)) > 0
    sweep = re.search(rf"sweep of 2 jobs: {NUMBER} s wall, {NUMBER} s of training", out)
    assert sweep and float(sweep.group(1)) > float(sweep.group(2)) > 0
    assert "overhead per job:" in out and "marginal cost of one more job:" in out


def test_plot_xiong2020_reads_a_real_sweep(tmp_path, commands, script_here):
    sweep = tmp_path / "sweep"
    train = commands.run(["normlab", "train", "-m", *TINY, "max_steps=2", "placement=pre,post", "wandb.mode=disabled",
                          "progress=false", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    out = script_here("repro/plot_xiong2020.py", "--init", str(sweep), "--runs", str(sweep), "--out", str(tmp_path / "report"),
                 cwd=tmp_path)
    for name in ("Pre-LN", "Post-LN"):  # step 0's FFN gradient of both blocks, from the telemetry
        grads = re.search(rf"{name} \(1 seeds\): L1:{NUMBER}\s+L2:{NUMBER}", out)
        assert grads and float(grads.group(1)) > 0 and float(grads.group(2)) > 0
    assert "last layer, Post-LN / Pre-LN:" in out
    assert len(re.findall(r"^\s+(pre|post)\s+\S+\s+\d+\s+completed\s+\d", out, re.M)) == 2
    for png in ("xiong2020_grad_init.png", "xiong2020_warmup.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_xiong2020_fig3_tables_the_step0_ffn_gradients_of_both_placements(tmp_path, commands, script_here):
    commands.intercept()  # its normlab sweep runs in this process too
    out = script_here("repro/xiong2020_fig3.py", "--widths", "32", "--seeds", "2", "--out", str(tmp_path / "fig3"),
                 "depth=2", "seq_len=16", "device=cpu", "batch_size=4", cwd=tmp_path)
    for name in ("Post-LN", "Pre-LN"):
        line = next(l for l in out.splitlines() if l.startswith(f"| 32 | {name} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == "2"  # both seeds were read back from the runs' telemetry
        first, last, ratio = float(cells[3]), float(cells[4]), float(cells[5])
        assert first > 0 and last > 0 and abs(ratio - last / first) < 0.01 + 0.01 * ratio


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA it measures for minutes")
def test_bench_gpu_says_in_one_line_that_there_is_no_gpu(tmp_path, script_here):
    out = script_here("bench/step_speed_gpu.py", "--rounds", "1", cwd=tmp_path)
    assert out.splitlines() == ["step_speed_gpu.py: no CUDA device: nothing to measure"]


def test_bench_gpu_runs_its_reference_and_normlab_variants_on_the_cpu_when_asked(tmp_path, script_here):
    """--cpu: the GPU benchmark's own code (reference loop, normlab runs, A/A control, table) runs here, figures
    aside: each variant's median over its windows of both rounds, with their interquartile range, and the raw times."""
    variants = ["ref eager", "normlab eager", "normlab eager again", "normlab eager telemetry/2", "normlab eager deterministic"]
    out = script_here("bench/step_speed_gpu.py", "--cpu", "--shapes", "tiny", "--rounds", "2", "--windows", "2", "--every", "2",
                      "--precision", "fp32", "--peak-size", "128", "--deterministic", "--aa", "--only", ",".join(variants),
                      "--json", str(tmp_path / "raw.json"), cwd=tmp_path)
    rows = {}
    for line in out.splitlines():
        name = next((v for v in sorted(variants, key=len, reverse=True) if line.startswith(v + " ")), None)
        if name:
            rows[name] = line[len(name):].split()
    assert list(rows) == variants
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["clock"] == "perf_counter" and list(raw["seconds_per_step"]["tiny"]) == variants
    for name, cells in rows.items():
        times = sorted(raw["seconds_per_step"]["tiny"][name])
        assert len(times) == 4 and cells[2] == "4"  # 2 rounds x 2 windows, all kept
        q1, q3 = map(float, cells[1].split("-"))
        assert float(cells[0]) == pytest.approx(1e3 * (times[1] + times[2]) / 2, abs=0.006)  # the median of four
        assert 1e3 * times[0] - 0.006 <= q1 <= float(cells[0]) <= q3 <= 1e3 * times[3] + 0.006
    ms = {name: float(cells[0]) for name, cells in rows.items()}
    assert float(rows["normlab eager"][-1]) == pytest.approx(ms["ref eager"] / ms["normlab eager"], abs=0.002)
    line = re.search(rf"telemetry overhead, normlab eager telemetry/2: ([+-]{NUMBER})% \(A/A: ([+-]{NUMBER})%\)", out)
    assert float(line.group(1)) == pytest.approx(100 * (ms["normlab eager telemetry/2"] / ms["normlab eager"] - 1), abs=0.2)
    assert float(line.group(3)) == pytest.approx(100 * (ms["normlab eager again"] / ms["normlab eager"] - 1), abs=0.2)
    assert re.search(r"deterministic=true costs, normlab eager deterministic: [+-][\d.]+% per step \(A/A: ", out)


def test_sweep_bench_times_a_sweep_per_setting_and_compares_its_losses(tmp_path, commands, script_here):
    commands.intercept()  # its three normlab sweeps run in this process too
    out = script_here("bench/sweep_throughput.py", "--per-gpu", "1,2", "--mps", "false,true", "norm=layer,rms", "model=tiny",
                      "max_steps=2", "batch_size=4", "seq_len=16", "eval_batches=1", "wandb.mode=disabled", "device=cpu",
                      cwd=tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("jobs_per_gpu=")]
    # One job per GPU under MPS is the same setting as without: not run twice.
    assert [line.split(":")[0] for line in lines] == ["jobs_per_gpu=1 mps=false", "jobs_per_gpu=2 mps=false",
                                                      "jobs_per_gpu=2 mps=true"]
    assert all("for 2 jobs (completed)" in line and "final val losses equal" in line for line in lines)


def test_pack_bench_times_runs_and_both_batchings(tmp_path, script_here):
    out = script_here("bench/pack.py", "--steps", "2", "--lrs", "1e-3", "--seeds", "0,1", "--rounds", "1",
                 "--kernel-steps", "1", "--overrides", "batch_size=4", "seq_len=16", "eval_batches=1", cwd=tmp_path)
    assert "2 runs of model=tiny" in out
    sequential, per_run, packed, ratio = map(float, re.search(
        rf"one after another {NUMBER} s \({NUMBER} s per run, measured\); packed {NUMBER} s; packed is {NUMBER}x", out).groups())
    # The seconds are printed to 0.01 s (0.001 s per run) and the ratio to 0.01: from the rounding alone the ratio of
    # the printed seconds moves by up to 0.005 s / packed and 0.005 s / sequential, relatively (a CI run: printed 0.4
    # against 0.35 s / 0.89 s = 0.393, when the tolerance left out the second term).
    assert sequential == pytest.approx(2 * per_run, abs=0.006)
    assert ratio == pytest.approx(sequential / packed, rel=0.01 + 0.006 / packed + 0.006 / sequential, abs=0.006)
    vmap_ms, grouped_ms = row(out, "kernels: vmap (normlab)", 1)[0], row(out, "kernels: grouped bmm", 1)[0]
    assert vmap_ms > 0 and grouped_ms > 0


def test_pack_bench_compares_the_packed_attention_paths(tmp_path, script_here):
    out = script_here("bench/pack.py", "--attention", "--precisions", "fp32,bf16", "--lrs", "1e-3", "--seeds", "0,1",
                      "--rounds", "1", "--kernel-steps", "1", "--overrides", "batch_size=2", "seq_len=16", cwd=tmp_path)
    for precision in ("fp32", "bf16"):
        lines = {path: line for line in out.splitlines() if line.startswith(f"attention {precision}: ")
                 for path in ("vmap (before)", "folded, math forced", "folded (normlab)") if path in line}
        assert len(lines) == 3, out
        # the vmap path runs each member's attention kernel (2 members x 2 layers), the folded one each layer's,
        # in the dtype autocast gives an unpacked run's attention
        assert re.search(r"flash_attention_for_cpu \w+ x4", lines["vmap (before)"])
        dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
        assert f"flash_attention_for_cpu {dtype} x2" in lines["folded (normlab)"]
        assert "matmuls and softmax" in lines["folded, math forced"]
        assert "loss 0.0e+00, gradient 0.0e+00" in lines["vmap (before)"]
    folded = re.search(rf"loss {NUMBER}, gradient {NUMBER}", out.split("attention fp32: folded (normlab)")[1])
    assert max(map(float, folded.groups())) <= 1e-5  # fp32: the same attention per batch row


def test_pack_bench_refuses_an_unknown_precision(tmp_path, commands):
    result = commands.run([sys.executable, SCRIPTS / "bench/pack.py", "--attention", "--precisions", "fp32,fp8"],
                          tmp_path, {**os.environ, "WANDB_MODE": "disabled"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "pack.py: --precisions 'fp32,fp8': each must be fp32, bf16 or fp16"


# ------------------------------------------------ the CPU-size reproductions: each script end to end, at a tiny size

# Hydra overrides for both sweeps of a *_cpu.sh script: a 2-block, 16-wide model for 2 steps (the presets'
# sizes are set by the preset, so they are overridden key by key, not by model=tiny).
TINY_REPRO = ["depth=2", "model.d_model=16", "model.n_head=2", "model.context=16", "seq_len=16", "batch_size=2",
              "max_steps=2", "eval_batches=1", "device=cpu", "wandb.mode=disabled"]  # fmt: skip
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def shell_script(commands):
    """shell_script(name, *args, cwd=...): scripts/`name` run by bash in `cwd`, its `normlab` and `python` commands
    in this process (tests/inprocess.py); asserts exit 0, returns its stdout."""

    def run(name: str, *args: str, cwd: Path) -> str:
        result = commands.bash(SCRIPTS / name, *args, cwd=cwd, env={**os.environ, "WANDB_MODE": "disabled"})
        assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        return result.stdout

    return run


def test_wortsman2023_cpu_tables_every_arm_over_the_lrs_and_draws_the_figure_into_docs(tmp_path, shell_script):
    out = shell_script("repro/wortsman2023_cpu.sh", *TINY_REPRO, "lr=1e-3,1e-1", cwd=tmp_path)
    arms = [f"{arm} qk_norm={qk}" for arm, qk in (("layer-pre", False), ("layer-pre", True), ("layer-post", False),
                                                  ("layer-post", True), ("rms-pre", False), ("dyt-pre", False))]  # fmt: skip
    for arm in arms:
        first, second, init, best, best_lr, sensitivity = row(out, arm, 6)
        assert best == min(first, second) and best_lr in (1e-3, 1e-1)
        assert sensitivity == pytest.approx((min(first, init) + min(second, init)) / 2 - best, abs=2e-3)
        assert row(out[out.index("largest attention logit"):], arm, 2)[1] > 0
    assert (tmp_path / "docs" / "wortsman2023_cpu_lr.png").read_bytes()[:8] == PNG


def test_xiong2020_warmup_cpu_runs_post_ln_at_three_warmups_and_pre_ln_without(tmp_path, shell_script):
    out = shell_script("repro/xiong2020_warmup_cpu.sh", *TINY_REPRO, cwd=tmp_path)
    for run in ("layer-post optim.warmup_steps=0 lr=1e-3", "layer-post optim.warmup_steps=50 lr=1e-3",
                "layer-post optim.warmup_steps=400 lr=1e-3", "layer-pre optim.warmup_steps=0 lr=1e-3"):  # fmt: skip
        at_init, final = row(out, run, 2)  # validation at steps 0 and 2
        assert 0 < final < at_init + 1
    assert "layer-pre optim.warmup_steps=50" not in out
    assert (tmp_path / "docs" / "xiong2020_warmup_cpu.png").read_bytes()[:8] == PNG


def test_zhu2025_cpu_compares_dyt_at_its_alpha_with_layernorm_and_rmsnorm(tmp_path, shell_script):
    out = shell_script("repro/zhu2025_cpu.sh", *TINY_REPRO, "lr=1e-3", cwd=tmp_path)
    for arm in ("layer-pre", "rms-pre", "dyt-pre norm.alpha_attn=0.8 norm.alpha_final=0.2 norm.alpha_mlp=0.2"):
        loss, init, best = row(out, arm, 3)
        assert loss == best and 0 < loss < init + 1
    alphas = out[out.index("α at the end"):]
    assert row(alphas, "attention", 1)[0] == pytest.approx(0.8, abs=0.01)  # two steps at lr 1e-3 barely move α₀
    assert row(alphas, "MLP", 1)[0] == pytest.approx(0.2, abs=0.01)
    assert row(alphas, "final", 1)[0] == pytest.approx(0.2, abs=0.01)
    assert (tmp_path / "docs" / "zhu2025_cpu_lr.png").read_bytes()[:8] == PNG


# ------------------------------------------------ the depth reproduction's script, on run dirs written by hand


def write_run(sweep: Path, name: str, placement: str, lr: float, seed: int, loss: float, telemetry: dict) -> None:
    """A run dir as train() leaves it: config.json, summary.json and metrics.jsonl with `telemetry`,
    {step: {stat: [value per block]}}, as per-layer keys (act/block_angle/L00, ...)."""
    run = sweep / name
    run.mkdir(parents=True)
    config = {"norm": {"name": "layer"}, "placement": placement, "lr": lr, "seed": seed, "depth": 3}
    (run / "config.json").write_text(json.dumps(config))
    summary = {**config, "norm": "layer", "status": "completed", "final_val_loss": loss}
    (run / "summary.json").write_text(json.dumps(summary))
    rows = []
    for step, stats in telemetry.items():
        layers = {f"{stat}/L{i:02d}": v for stat, values in stats.items() for i, v in enumerate(values)}
        rows.append({"step": step, "loss": loss, **layers})
    rows[-1]["val_loss"] = loss
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_depth_block_angle_tables_each_placement_at_its_best_lr_and_draws_both_panels(tmp_path, script_here):
    sweep = tmp_path / "sweep"
    angle, ratio, rms = "act/block_angle", "act/max_median", "act/resid_rms"
    init = {angle: [60, 50, 40], ratio: [3, 4, 5], rms: [0.1, 0.2, 0.3]}
    end = lambda angles, ratios, rmss: {0: init, 9: {angle: angles, ratio: ratios, rms: rmss}}  # noqa: E731
    write_run(sweep, "0_pre_s0", "pre", 3e-3, 0, 2.5, end([40, 20, 10], [10, 30, 20], [1, 2, 4]))
    write_run(sweep, "1_pre_s1", "pre", 3e-3, 1, 2.7, end([50, 30, 20], [10, 50, 20], [1, 2, 6]))
    write_run(sweep, "2_pre_hi", "pre", 1e-2, 0, 3.0, end([1, 1, 1], [99, 99, 99], [9, 9, 9]))
    for seed in (0, 1):
        write_run(sweep, f"3_lns_s{seed}", "lns", 3e-3, seed, 2.4, end([30, 30, 30], [8, 6, 7], [1, 1, 1]))
    out = script_here("repro/depth_block_angle.py", str(sweep), "--figure", str(tmp_path / "angle.png"), cwd=tmp_path)
    table = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in out.splitlines()[:4]}
    # pre at lr 3e-3 (mean 2.6), not at 1e-2 (3.0); its end figures are the two seeds' means, per block.
    assert table["pre (Pre-LN)"] == ["pre (Pre-LN)", "3e-3", "2", "2.600 ± 0.141", "45.0 / 15.0", "5 (block 3)",
                                     "40 (block 2)", "5"]  # fmt: skip
    assert table["lns (LayerNorm Scaling)"][1:] == ["3e-3", "2", "2.400 ± 0.000", "30.0 / 30.0", "5 (block 3)",
                                                   "8 (block 1)", "1"]  # fmt: skip
    at_init, at_end = out.split("block angle (°) per block at ")[1:]
    assert "| pre (Pre-LN) | 60 | 50 | 40 |" in at_init and "(telemetry step: pre 0; lns 0)" in at_init
    assert "| pre (Pre-LN) | 45 | 25 | 15 |" in at_end and "(telemetry step: pre 9; lns 9)" in at_end
    assert (tmp_path / "angle.png").read_bytes()[:8] == PNG


def test_depth_block_angle_tables_the_papers_variants_and_names_eps_dominated_norms(tmp_path, script_here):
    sweep = tmp_path / "sweep"
    for seed, ratio in ((0, 0.5), (1, 0.25)):
        telemetry = {0: {"act/block_angle": [10, 20], "act/block_angle_last": [12, 30 + seed],
                         "act/top_median": [5, 7], "norm/eps_ratio": [ratio, 3]},
                     9: {"act/block_angle": [10, 20], "act/block_angle_last": [14, 40],
                         "act/top_median": [6, 1000], "norm/eps_ratio": [2, 3]}}
        write_run(sweep, f"{seed}_reordered", "reordered", 3e-3, seed, 2.5, telemetry)
    out = script_here("repro/depth_block_angle.py", str(sweep), cwd=tmp_path)
    last = out[out.index("act/block_angle_last"):]
    assert "| reordered (OLMo 2) | 14 | 40 |" in last
    assert "| reordered (OLMo 2) | 6 | 1e+03 |" in out[out.index("(act/top_median)"):]
    # write_run names per-layer keys STAT/L00: the eps slots read as L00 and L01 here
    assert out.splitlines()[-1] == "- reordered (OLMo 2): step 0: L00 0.25"


def test_depth_block_angle_says_in_one_line_when_no_run_logged_the_block_angle(tmp_path, script_here):
    sweep = tmp_path / "sweep"
    write_run(sweep, "0_pre", "pre", 3e-3, 0, 2.5, {0: {"act/resid_rms": [1, 2]}, 9: {"act/resid_rms": [1, 3]}})
    out = script_here("repro/depth_block_angle.py", str(sweep), "--figure", str(tmp_path / "angle.png"), cwd=tmp_path)
    assert out.splitlines()[2] == "| pre (Pre-LN) | 3e-3 | 1 | 2.500 | — | — | — | 3 |"
    assert out.splitlines()[-1].startswith("no act/block_angle in these runs") and not (tmp_path / "angle.png").exists()


def test_overhead_bench_times_both_commands_against_the_base(tmp_path):
    out = script("bench/overhead.py", "--repeats", "1", "--jobs", "2", "--cpu-jobs", "1", "--steps", "2", *TINY[1:],
                 "wandb.mode=disabled", "telemetry.every=0", cwd=tmp_path)
    assert re.search(r"^base \w+: \S+/base/normlab/__init__\.py \S+/base/normlab/conf$", out, re.M)
    for name in ("base", "new"):
        single = re.search(rf"^  {name}\s+{NUMBER} s wall\s+{NUMBER} s CPU", out, re.M)
        assert single and float(single.group(1)) > 0 and float(single.group(2)) > 0
        sweep = re.search(rf"^  {name}\s+{NUMBER} s wall\s+{NUMBER} s CPU; training loops\s+{NUMBER} s by phases "
                          rf"\(outside\s+{NUMBER}%\),\s+{NUMBER} s by train_time_s", out, re.M)
        assert sweep and 0 < float(sweep.group(3)) < float(sweep.group(1)) and 0 < float(sweep.group(4)) < 100
