"""Tests for `normlab compare`: run discovery, arms, the LR sensitivity, report.md, plots, errors,
and the whole path on a small real sweep."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli_here import normlab_here
from normlab import cli
from normlab.analysis import CompareError, build_comparison, find_run_dirs, load_run, load_runs, lr_sensitivity
from normlab.analysis.compare import compare
from normlab.config import RunConfig, format_lr, nest_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = ("loss_train.png", "loss_val.png", "final_val_loss_vs_lr.png", "layers_grad_norm.png", "layers_resid_rms.png")


# ------------------------------------------------------------------------------------------ helpers


def write_run(
    path: Path,
    *,
    norm="rms",
    placement="pre",
    lr=1e-3,
    seed=0,
    depth=2,
    init=5.5,
    final=3.0,
    status="completed",
    diverged_step=None,
    error=None,
    max_steps=8,
    telemetry=False,
    extra_config=None,
    config="json",
) -> Path:
    """A run dir as `normlab train` writes it: metrics.jsonl rows, summary.json, and its config.

    `config` is "json" (config.json: the whole RunConfig tree, as train() writes it), "hydra" (only
    Hydra's .hydra/config.yaml with a few keys, as in run dirs of earlier versions) or None (no config).
    `extra_config` sets further config keys, dotted: {"optim.warmup_steps": 7}.

    Losses fall linearly from `init` at step 0 to `final` at max_steps. A diverged run's last row is
    the lead's `"status": "diverged"` row, with a non-finite loss; a failed run stops half-way.
    With `telemetry`, every other step carries per-layer keys act/resid_rms/Lxx and grad/norm/Lxx whose
    values encode (step, layer): resid_rms = 1 + step + layer/10, grad/norm = (layer + 1) * 10**-step.
    """
    path.mkdir(parents=True)
    last = {"diverged": diverged_step, "failed": max_steps // 2}.get(status, max_steps)
    rows, best = [], math.inf
    for step in range(last + 1):
        loss = init + (final - init) * step / max_steps
        row = {"step": step, "tokens": 256 * step}
        if status == "diverged" and step == last:
            row.update(loss=None, lr=lr, grad_norm="inf", status="diverged")
            rows.append(row)
            break
        if step % 4 == 0 or step == max_steps:
            row["val_loss"] = loss
            best = min(best, loss)
        if step < max_steps:
            row.update(loss=loss + 0.01, lr=lr, grad_norm=1.5, tokens_per_s=50000.0)
        if telemetry and step % 2 == 0 and step < max_steps:
            for layer in range(depth):
                row[f"act/resid_rms/L{layer:02d}"] = 1 + step + layer / 10
                row[f"grad/norm/L{layer:02d}"] = (layer + 1) * 10.0**-step
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "name": f"{norm}-{placement}-d{depth}-lr{format_lr(lr)}-s{seed}",
        "norm": norm,
        "placement": placement,
        "depth": depth,
        "lr": lr,
        "seed": seed,
        "status": status,
        "final_val_loss": final if status == "completed" else None,
        "best_val_loss": best if math.isfinite(best) else None,
        "steps": last,
        "tokens": 256 * last,
        "tokens_per_s": 51234.6,
        "wall_time_s": 1.5,
    }
    if diverged_step is not None:
        summary["diverged_step"] = diverged_step
    if error is not None:
        summary["error"] = error
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
    settings = {
        "depth": depth, "norm.name": norm, "norm.eps": 1e-5, "placement": placement, "lr": lr, "seed": seed,
        "max_steps": max_steps, "progress": False, "wandb.mode": "offline", **(extra_config or {}),
    }  # fmt: skip
    if config == "json":
        (path / "config.json").write_text(json.dumps(nest_config(settings, into=RunConfig().to_dict()), indent=2))
    elif config == "hydra":
        (path / ".hydra").mkdir()
        (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(nest_config(settings, into={})))
    return path



def table(report: str, heading: str) -> list[dict[str, str]]:
    """The first Markdown table under `## heading`, as one dict per row (backticks stripped)."""
    section = report.split(f"## {heading}\n", 1)[1]
    all_lines = section.splitlines()
    start = next(i for i, line in enumerate(all_lines) if line.startswith("|"))
    lines = []
    for line in all_lines[start:]:
        if not line.startswith("|"):
            break
        lines.append(line)
    cells = [[c.strip().strip("`") for c in line.strip("|").split(" | ")] for line in lines]
    header, rows = cells[0], cells[2:]
    section_rows = []
    for row in rows:
        assert len(row) == len(header), row
        section_rows.append(dict(zip(header, row)))
    return section_rows


def fmt(value) -> str:
    return "—" if value is None else f"{value:.4f}"


# ------------------------------------------------------------------------------------------ LR sensitivity


def test_lr_sensitivity_matches_a_hand_computation():
    # ℓ* = 2.5; terms min(ℓ, ℓ₀) − ℓ*: 3.0 → 0.5, 2.5 → 0, 2.8 → 0.3, diverged (+inf) → 5.5 − 2.5 = 3.0
    losses = {1e-3: 3.0, 3e-3: 2.5, 1e-2: 2.8, 3e-2: math.inf}
    assert lr_sensitivity(losses, init_loss=5.5) == pytest.approx((0.5 + 0 + 0.3 + 3.0) / 4)  # 0.95
    # A finite loss above ℓ₀ is clipped to ℓ₀ like a divergence: 6.0 → 5.5 − 2.5 = 3.0
    assert lr_sensitivity({1e-3: 2.5, 1e-2: 6.0}, init_loss=5.5) == pytest.approx(1.5)
    assert math.isnan(lr_sensitivity({1e-3: 4.0}, init_loss=5.5))  # one lr: no sensitivity (its formula gives 0)
    assert math.isnan(lr_sensitivity({1e-3: math.inf, 1e-2: math.inf}, init_loss=5.5))
    assert math.isnan(lr_sensitivity({1e-3: 3.0}, init_loss=math.nan))


def test_arm_sensitivity_averages_seeds_first_and_reports_their_spread(tmp_path):
    sweep = tmp_path / "sweep"
    # seed 0: ℓ₀ = 5.5, seed 1: ℓ₀ = 5.7 (arm ℓ₀ = 5.6); seed 0 diverges at lr 1e-1
    write_run(sweep / "0", lr=1e-3, seed=0, init=5.5, final=3.0)
    write_run(sweep / "1", lr=1e-3, seed=1, init=5.7, final=3.2)
    write_run(sweep / "2", lr=1e-2, seed=0, init=5.5, final=2.6)
    write_run(sweep / "3", lr=1e-2, seed=1, init=5.7, final=2.8)
    write_run(sweep / "4", lr=1e-1, seed=0, init=5.5, status="diverged", diverged_step=3)
    write_run(sweep / "5", lr=1e-1, seed=1, init=5.7, final=3.9)

    [arm] = build_comparison(find_run_dirs([sweep])).arms
    # seed means ℓ: 3.1, 2.7, +inf; ℓ* = 2.7; terms 0.4, 0, 5.6 − 2.7 = 2.9 → 1.1
    assert arm.init_loss == pytest.approx(5.6)
    assert arm.best_loss == pytest.approx(2.7) and arm.best_lr == 1e-2
    assert arm.sensitivity == pytest.approx(1.1)
    # per seed: seed 0 {3.0, 2.6, inf}, ℓ₀ 5.5 → (0.4 + 0 + 2.9)/3 = 1.1; seed 1 {3.2, 2.8, 3.9}, ℓ₀ 5.7 → (0.4 + 0 + 1.1)/3 = 0.5
    assert arm.sensitivity_std == pytest.approx(math.sqrt(((1.1 - 0.8) ** 2 + (0.5 - 0.8) ** 2) / 1))
    assert arm.n_seeds_for_std == 2

    report = (compare([str(sweep)]) / "report.md").read_text()
    [row] = table(report, "LR sensitivity")
    assert row["arm"] == "rms-pre"
    assert row["learning rates"] == "1e-3, 1e-2, 1e-1"
    assert (row["ℓ₀ (init)"], row["ℓ* (best)"], row["best lr"]) == ("5.6000", "2.7000", "1e-2")
    assert row["LR sensitivity"] == "1.1000"
    assert row["std over seeds"] == "0.4243 (2 seeds)"
    assert row["diverged/failed"] == "1 of 6"
    seeds = {r["lr"]: r for r in table(report, "Seeds")}
    assert seeds["1e-3"]["final val loss"] == "3.1000 ± 0.1414"
    assert seeds["1e-1"]["final val loss"] == "3.9000"  # the diverged seed is counted apart, not averaged in
    assert seeds["1e-1"]["diverged/failed seeds"] == "1"


# ------------------------------------------------------------------------------------------ runs and arms


def test_diverged_run_is_cut_at_its_divergence_step_and_never_shows_nan(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "ok", norm="layer", lr=1e-3)
    write_run(sweep / "boom", norm="none", lr=1.0, status="diverged", diverged_step=5)
    write_run(sweep / "crash", norm="layer", lr=1e-2, status="failed", error="RuntimeError: out of memory")
    run = load_run(sweep / "boom")
    assert run.status == "diverged" and run.diverged_step == 5
    assert math.isnan(run.final_val_loss) and run.outcome_loss == math.inf
    steps, losses = run.curve("loss")
    assert steps == [0, 1, 2, 3, 4] and all(math.isfinite(v) for v in losses)
    assert run.curve("val_loss")[0] == [0, 4]

    out = compare([str(sweep)], out=tmp_path / "report")
    report = (out / "report.md").read_text()
    assert not re.search(r"\b(nan|NaN|inf)\b", report)
    rows = {r["run"]: r for r in table(report, "Runs")}
    assert rows["boom"]["status"] == "diverged"
    assert rows["boom"]["diverged at step"] == "5"
    assert rows["boom"]["final val loss"] == "—"
    assert rows["boom"]["best val loss"] == "4.2500"  # the step-4 eval, before it diverged
    assert rows["crash"]["status"] == "failed" and rows["crash"]["diverged at step"] == "—"
    assert "- `crash`: RuntimeError: out of memory" in report
    assert rows["ok"]["diverged at step"] == "—" and rows["ok"]["final val loss"] == "3.0000"
    # arms in normlab's order (none before layer), each run under its arm, lrs ascending
    assert list(rows) == ["boom", "ok", "crash"]


def test_a_killed_run_is_listed_but_left_out_of_the_sensitivity(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "a", lr=1e-3, final=3.0)
    write_run(sweep / "b", lr=1e-2, final=2.0)
    killed = write_run(sweep / "c", lr=1e-1, final=2.5)
    summary = json.loads((killed / "summary.json").read_text())
    summary.update(status="running", final_val_loss=None)
    (killed / "summary.json").write_text(json.dumps(summary))
    with open(killed / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 9, "loss": 2.')  # a line cut off when the process was killed

    comparison = build_comparison(find_run_dirs([sweep]))
    [arm] = comparison.arms
    # only 1e-3 and 1e-2 count: ℓ* = 2.0, (1.0 + 0)/2
    assert arm.sensitivity == pytest.approx(0.5)
    report = (compare([str(sweep)]) / "report.md").read_text()
    assert {r["run"]: r["status"] for r in table(report, "Runs")}["c"] == "running"
    assert "c has status 'running' (killed or still running): left out of the LR sensitivity" in report
    assert "c: 1 line(s) of metrics.jsonl were not readable rows (torn, not UTF-8 JSON, or of the wrong types) and were ignored" in report


def test_config_keys_that_differ_split_arms_but_lr_and_seed_do_not(tmp_path):
    root = tmp_path / "outputs" / "sweeps"
    for depth in (4, 12):
        for lr in (1e-3, 1e-2):
            for seed in (0, 1):
                write_run(root / "s1" / f"d{depth}-{lr}-{seed}", depth=depth, lr=lr, seed=seed, extra_config={"log_every": 1})
    # log_every differs too, but changes no number: it must not split arms
    write_run(root / "s2" / "x", depth=4, lr=1e-1, extra_config={"log_every": 5})
    comparison = build_comparison(find_run_dirs([tmp_path / "outputs"]))
    labels = [a.arm.label for a in comparison.arms]
    assert labels == ["depth=4", "depth=12"]  # numbers sort as numbers; norm and placement do not vary
    assert [len(a.runs) for a in comparison.arms] == [5, 4]
    assert [p.lr for p in comparison.arms[0].points] == [1e-3, 1e-2, 1e-1]


@pytest.mark.parametrize("config", ["json", "hydra"])
def test_runs_that_differ_only_in_bookkeeping_are_one_arm(tmp_path, config):
    sweep = tmp_path / "sweep"
    write_run(sweep / "a", lr=1e-3, config=config, extra_config={"ckpt.every": 100, "resume": "auto"})
    write_run(sweep / "b", lr=1e-2, config=config, extra_config={"ckpt.every": 5, "ckpt.keep": 3, "resume": None, "tf32": False})
    # resumed from a checkpoint: resume=PATH is written into its config
    write_run(sweep / "c", lr=1e-1, config=config, extra_config={"resume": "/scratch/run/checkpoints/step-000120.pt"})
    [arm] = build_comparison(find_run_dirs([sweep])).arms
    assert arm.arm.label == "rms-pre" and len(arm.runs) == 3  # one arm: its full name
    # a key that changes the result still splits the arm
    write_run(tmp_path / "other" / "d", lr=1e-3, config=config, extra_config={"resume": "auto", "optim.warmup_steps": 7})
    write_run(tmp_path / "other" / "e", lr=1e-3, config=config, extra_config={"resume": "/x/step-4.pt", "optim.warmup_steps": 50})
    labels = [a.arm.label for a in build_comparison(find_run_dirs([tmp_path / "other"])).arms]
    assert labels == ["optim.warmup_steps=7", "optim.warmup_steps=50"]


def test_a_norm_knob_splits_only_the_arms_of_the_norms_that_read_it(tmp_path):
    # `norm=layer,dyt norm.alpha_attn=0.5,1.0`: the override reaches LayerNorm's config too, which never reads it.
    for norm in ("layer", "dyt"):
        for alpha in (0.5, 1.0):
            for seed in (0, 1):
                for lr in (1e-3, 1e-2):
                    write_run(tmp_path / f"{norm}-{alpha}-{seed}-{lr}", norm=norm, seed=seed, lr=lr,
                              final=3.0 + seed / 10 + lr, extra_config={"norm.alpha_attn": alpha})
    comparison = build_comparison(find_run_dirs([tmp_path]))
    assert [(a.arm.label, len(a.runs)) for a in comparison.arms] == [
        ("layer", 4), ("dyt norm.alpha_attn=0.5", 4), ("dyt norm.alpha_attn=1.0", 4)
    ]
    # LayerNorm's runs at alpha_attn=1.0 are the same trainings as those at 0.5: counted once, each noted.
    assert sum("the same training as layer-0.5-" in note for note in comparison.notes) == 4
    layer, dyt = comparison.arms[0], comparison.arms[1]
    assert layer.n_seeds_for_std == dyt.n_seeds_for_std == 2


def test_config_json_is_read_and_hydras_config_only_without_it(tmp_path):
    new = write_run(tmp_path / "new", extra_config={"init": "xavier", "optim.warmup_steps": 7})
    (new / ".hydra").mkdir()  # a stale Hydra config beside normlab's own: not read
    (new / ".hydra" / "config.yaml").write_text("init: normal\noptim:\n  warmup_steps: 50\n")
    run = load_run(new)
    assert (run.settings["init"], run.settings["optim.warmup_steps"]) == ("xavier", 7)
    assert run.settings["model.d_model"] == RunConfig().model.d_model  # the whole RunConfig tree
    assert run.settings["optim.betas"] == tuple(RunConfig().optim.betas)
    # an old run dir (Hydra's config only) and a new one with the same settings are one arm
    old = write_run(tmp_path / "sweep" / "old", lr=3e-3, config="hydra", extra_config={"init": "xavier"})
    assert load_run(old).settings["init"] == "xavier"
    write_run(tmp_path / "sweep" / "new", lr=1e-3, extra_config={"init": "xavier"})
    write_run(tmp_path / "sweep" / "normal", lr=1e-3, extra_config={"init": "normal"})
    comparison = build_comparison(find_run_dirs([tmp_path / "sweep"]))
    assert [(a.arm.label, len(a.runs)) for a in comparison.arms] == [("init=normal", 1), ("init=xavier", 2)]


def test_runs_trained_from_python_are_compared_by_their_config_json(tmp_path):
    from conftest import tiny_config
    from normlab.train.run import train

    summaries = {}
    for lr, every in ((1e-3, 2), (3e-3, 4)):  # ckpt.every differs too: bookkeeping, one arm
        cfg = tiny_config("rms", "post", lr=lr, init="xavier")
        cfg.wandb.mode = "disabled"
        cfg.ckpt.every = every
        run_dir = tmp_path / "sweep" / format_lr(lr)
        summaries[lr] = train(cfg, run_dir)
        # What train() writes into the run dir (no Hydra dir: it was not run by `normlab train`).
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    [arm] = build_comparison(find_run_dirs([tmp_path / "sweep"])).arms
    assert arm.arm.label == "rms-post" and [p.lr for p in arm.points] == [1e-3, 3e-3]
    for point in arm.points:
        [run] = point.runs
        assert (run.settings["init"], run.settings["model.d_model"]) == ("xavier", 32)
        assert run.final_val_loss == summaries[point.lr]["final_val_loss"]


def test_runs_are_found_recursively_but_not_inside_wandb_or_hidden_dirs(tmp_path):
    outputs = tmp_path / "outputs"
    write_run(outputs / "runs" / "r1")
    write_run(outputs / "sweeps" / "s" / "0_a")
    write_run(outputs / "sweeps" / "s" / "1_b")
    (outputs / "runs" / "r1" / "wandb" / "offline-run-x").mkdir(parents=True)
    (outputs / "runs" / "r1" / "wandb" / "offline-run-x" / "summary.json").write_text("{}")
    (outputs / "sweeps" / "s" / ".cache" / "z").mkdir(parents=True)
    (outputs / "sweeps" / "s" / ".cache" / "z" / "summary.json").write_text("{}")
    found = find_run_dirs([outputs, outputs / "sweeps" / "s" / "0_a" / "summary.json"])
    assert sorted(p.name for p in found) == ["0_a", "1_b", "r1"]


def test_run_without_a_config_falls_back_to_its_summary(tmp_path):
    run_dir = write_run(tmp_path / "r", norm="layer", placement="post", lr=3e-3, seed=4, depth=6, config=None)
    run = load_run(run_dir)
    assert (run.norm, run.placement, run.depth, run.lr, run.seed) == ("layer", "post", 6, 3e-3, 4)
    other = write_run(tmp_path / "q", norm="layer", placement="post", lr=1e-3, seed=4, depth=6)
    comparison = build_comparison([run_dir, other])
    assert [a.arm.label for a in comparison.arms] == ["layer-post"]  # a missing config must not split the arm


def test_load_runs_reads_every_run_dir_under_the_paths_sorted_by_path_as_a_table(tmp_path):
    outputs = tmp_path / "outputs"
    sweep = outputs / "sweeps" / "s"
    write_run(sweep / "1_b", norm="layer", lr=1e-2, seed=1, final=2.5)
    write_run(sweep / "0_a", lr=1e-3, seed=0, final=3.0, extra_config={"optim.warmup_steps": 7})
    killed = write_run(outputs / "runs" / "r1", lr=3e-3)
    (killed / "summary.json").unlink()
    (sweep / "0_a" / "wandb" / "offline-run-x").mkdir(parents=True)
    (sweep / "0_a" / "wandb" / "offline-run-x" / "summary.json").write_text("{}")

    runs = load_runs(outputs, sweep / "0_a")  # a run dir also under outputs/ is loaded once
    assert [run.path for run in runs] == [(outputs / p).resolve() for p in ("runs/r1", "sweeps/s/0_a", "sweeps/s/1_b")]
    rows = [{**run.settings, **run.summary} for run in runs]
    assert [(row["norm.name"], row["lr"], row["seed"], row["status"]) for row in rows] == [
        ("rms", 3e-3, 0, "incomplete"), ("rms", 1e-3, 0, "completed"), ("layer", 1e-2, 1, "completed"),
    ]  # fmt: skip
    assert [row.get("final_val_loss") for row in rows] == [None, 3.0, 2.5]
    assert rows[1]["optim.warmup_steps"] == 7 and rows[1]["max_steps"] == 8 and rows[2]["depth"] == 2
    assert runs[0].last_step == 8 and len(runs[1].rows) == 9
    assert [run.path for run in load_runs(sweep)] == [(sweep / "0_a").resolve(), (sweep / "1_b").resolve()]
    assert load_runs() == []
    with pytest.raises(CompareError, match="no such file or directory"):
        load_runs(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ report dir


def test_per_layer_plots_use_the_first_and_last_telemetry_rows(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "a", norm="layer", placement="post", depth=3, telemetry=True)
    write_run(sweep / "b", norm="none", placement="pre", depth=3, lr=1e-3, telemetry=True, status="diverged", diverged_step=5)
    run = load_run(sweep / "a")
    assert run.layer_profile("act/resid_rms", "first") == {0: 1.0, 1: 1.1, 2: 1.2}  # step 0
    assert run.layer_profile("act/resid_rms", "last") == {0: 7.0, 1: 7.1, 2: 7.2}  # step 6, the last telemetry row
    assert run.layer_profile("grad/norm", "first") == {0: 1.0, 1: 2.0, 2: 3.0}
    # the diverged run's last profile is the last telemetry row before step 5
    assert load_run(sweep / "b").layer_profile("act/resid_rms", "last") == {0: 5.0, 1: 5.1, 2: 5.2}

    out = compare([str(sweep)])
    assert out == sweep.resolve() / "report"
    for name in ALL_PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    report = (out / "report.md").read_text()
    assert "![per-layer gradient norm at initialization and at the end](layers_grad_norm.png)" in report
    assert "Not drawn" not in report


def test_without_telemetry_the_per_layer_plots_are_skipped_with_a_note(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "a", lr=1e-3)
    write_run(sweep / "b", lr=1e-2)
    out = tmp_path / "report"
    out.mkdir()
    (out / "layers_grad_norm.png").write_bytes(PNG_MAGIC)  # left by an earlier report of other runs
    compare([str(sweep)], out=out)
    for name in ALL_PLOTS[:3]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    assert not (out / "layers_grad_norm.png").exists() and not (out / "layers_resid_rms.png").exists()
    report = (out / "report.md").read_text()
    assert "Not drawn: no run logged per-layer `grad/norm/L..` telemetry." in report
    assert "Not drawn: no run logged per-layer `act/resid_rms/L..` telemetry." in report


def test_default_report_dir_is_the_sweeps_report_else_outputs_reports(tmp_path, monkeypatch):
    write_run(tmp_path / "outputs" / "sweeps" / "s1" / "0_a")
    write_run(tmp_path / "outputs" / "sweeps" / "s2" / "0_b", seed=1)  # the same seed would be a repeat of 0_a
    monkeypatch.chdir(tmp_path)
    assert compare(["outputs/sweeps/s1"]) == (tmp_path / "outputs" / "sweeps" / "s1" / "report").resolve()
    for paths in (["outputs"], ["outputs/sweeps/s1", "outputs/sweeps/s2"], ["outputs/sweeps/s1/0_a"]):
        out = compare(paths)
        assert out.parent == Path("outputs/reports") and (out / "report.md").is_file()
        report = (out / "report.md").read_text()
        assert len(table(report, "Runs")) == (1 if paths[0].endswith("0_a") else 2)


# ------------------------------------------------------------------------------------------ command line


def test_cli_prints_the_ranked_table_then_the_report_path(tmp_path, capsys):
    write_run(tmp_path / "sweep" / "a")
    assert cli.main(["compare", str(tmp_path / "sweep"), "--out", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"report: {tmp_path / 'r' / 'report.md'}"
    assert lines[0] == "1 run in 1 arm. Best: rms-pre at lr=1e-3, final val loss 3.0000 (1 seed)."
    heads = [line.split() for line in lines if line.startswith("rank  arm")]  # blocks of at most 120 columns
    assert lines[2].startswith("rank  arm") and max(map(len, lines[2:-3])) <= 120
    assert [word for head in heads for word in head[2:]] == ["final", "val", "loss", "seeds", "best", "lr", "gap", "to",
        "best", "95%", "interval", "vs", "best", "LR", "sensitivity", "diverged/failed", "max", "grad", "norm", "max",
        "attn", "logit", "loss", "spikes"]  # fmt: skip
    assert lines[3].split()[:6] == ["1", "rms-pre", "3.0000", "1", "1e-3", "(only)"]
    assert (tmp_path / "r" / "report.md").is_file()


def run_compare_cli(args: list[str]) -> int:
    try:
        return cli.main(["compare", *args])
    except SystemExit as exit:  # argparse exits on its own
        return exit.code


@pytest.mark.parametrize(
    "args, message",
    [
        (["nowhere"], "normlab: error: nowhere: no such file or directory"),
        (["empty"], "normlab: error: no runs under empty: a run dir holds summary.json, metrics.jsonl or config.json"),
        (["notes.txt"], "normlab: error: notes.txt: not a directory: give a run dir, a sweep dir or the outputs/ root"),
        (["broken"], "normlab: error: no readable runs: {tmp}/broken/summary.json: unreadable ("),
        ([], "normlab: error: compare: the following arguments are required: PATH"),
    ],
)
def test_bad_paths_give_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty" / "wandb").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text('{"norm": "rms", ')
    assert run_compare_cli(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message.format(tmp=tmp_path.resolve())), err
    assert not (tmp_path / "outputs").exists()  # nothing written on bad input


def test_normlab_help_and_compare_do_not_import_torch_or_wandb():
    code = (
        "import sys, normlab.cli; normlab.cli.main(['--help']); heavy = {'torch', 'wandb', 'matplotlib'} & set(sys.modules); "
        "import normlab.analysis, normlab.analysis.compare, normlab.analysis.render.report, normlab.analysis.render.plots; "
        "print(sorted(heavy), sorted({'torch', 'wandb'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("[] []"), out


def test_compare_help_does_not_import_torch_wandb_or_matplotlib():
    code = (
        "import sys, normlab.cli\n"
        "try:\n    normlab.cli.main(['compare', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'wandb', 'matplotlib'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: normlab compare" in out and out.strip().endswith("[]"), out


# ------------------------------------------------------------------------------------------ a real sweep


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory):
    """A four-run sweep made by the real `normlab train -m` (in this process: the runs are the point, not the
    process), tiny and fast, in its own cwd."""
    cwd = tmp_path_factory.mktemp("real-sweep")
    # compare reads run files, not wandb: no wandb run (about two seconds a job).
    args = ("model=tiny max_steps=6 eval_every=3 log_every=1 seq_len=32 batch_size=8 lr=1e-3,3e-3 norm=layer,rms progress=false"
            " device=cpu wandb.mode=disabled")
    with pytest.MonkeyPatch.context() as patch:  # the per-test token cache is not set up yet at module scope
        patch.setenv("NORMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        result = normlab_here("train", "-m", *args.split(), cwd=cwd)
    assert result.returncode in (0, None), result.stderr[-3000:]
    [sweep] = (cwd / "outputs" / "sweeps").iterdir()
    return cwd, sweep


def test_compare_on_a_real_sweep_reports_the_summary_numbers(real_sweep, monkeypatch, capsys):
    cwd, sweep = real_sweep
    monkeypatch.chdir(cwd)
    # In this process: the command line is test_cli_prints_the_report_dir's, the real runs are the point here.
    assert cli.main(["compare", str(sweep.relative_to(cwd))]) == 0
    out = Path(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("report: ")).parent
    assert out.resolve() == (sweep / "report").resolve()
    for name in ALL_PLOTS[:3]:
        png = (out / name).read_bytes()
        assert png[:8] == PNG_MAGIC and len(png) > 10_000, name

    report = (out / "report.md").read_text()
    rows = {r["run"]: r for r in table(report, "Runs")}
    run_dirs = sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file())
    assert sorted(rows) == [p.name for p in run_dirs] and len(rows) == 4
    init_losses, finals = {}, {}
    for run_dir in run_dirs:
        s = json.loads((run_dir / "summary.json").read_text())
        row = rows[run_dir.name]
        assert (row["norm"], row["placement"], row["depth"], row["seed"]) == (s["norm"], s["placement"], str(s["depth"]), str(s["seed"]))
        assert row["lr"] == format_lr(s["lr"])
        assert row["final val loss"] == fmt(s["final_val_loss"])
        assert row["best val loss"] == fmt(s["best_val_loss"])
        assert row["status"] == s["status"] == "completed"
        assert row["tokens/s"] == f"{s['tokens_per_s']:.0f}"
        assert row["diverged at step"] == "—"
        step0 = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        assert step0["step"] == 0
        init_losses.setdefault(s["norm"], []).append(step0["val_loss"])
        finals.setdefault(s["norm"], {})[s["lr"]] = s["final_val_loss"]

    sensitivity = {r["arm"]: r for r in table(report, "LR sensitivity")}
    assert sorted(sensitivity) == ["layer", "rms"]  # the placement is pre in every run: not in the labels
    for norm, by_lr in finals.items():
        init = sum(init_losses[norm]) / len(init_losses[norm])
        best = min(by_lr.values())
        expected = sum(min(v, init) - best for v in by_lr.values()) / len(by_lr)
        row = sensitivity[norm]
        assert row["LR sensitivity"] == f"{expected:.4f}"
        assert row["ℓ₀ (init)"] == f"{init:.4f}" and row["ℓ* (best)"] == f"{best:.4f}"
    assert "## Seeds" not in report  # one seed per arm and lr


# ------------------------------------------------------------------------------------------ damaged input


def test_a_run_killed_before_its_summary_is_listed_as_incomplete_with_its_last_step(tmp_path):
    sweep = tmp_path / "sweep"
    write_run(sweep / "done", lr=1e-3)
    killed = write_run(sweep / "killed", lr=1e-2, max_steps=8)
    (killed / "summary.json").unlink()
    started = write_run(sweep / "started", lr=1e-1)  # killed before its first row: config.json only
    (started / "summary.json").unlink()
    (started / "metrics.jsonl").unlink()
    assert sorted(p.name for p in find_run_dirs([sweep])) == ["done", "killed", "started"]
    run = load_run(killed)
    assert run.status == "incomplete" and run.last_step == 8 and run.outcome_loss is None
    report = (compare([str(sweep)], out=tmp_path / "r") / "report.md").read_text()
    rows = {r["run"]: r for r in table(report, "Runs")}
    assert rows["killed"]["status"] == "incomplete" and rows["killed"]["lr"] == "1e-2"
    assert rows["started"]["status"] == "incomplete" and rows["started"]["norm"] == "rms"
    assert "- `killed`: last step 8" in report and "- `started`: last step —" in report
    [arm] = build_comparison(find_run_dirs([sweep])).arms
    assert [p.lr for p in arm.points if p.counted] == [1e-3]  # incomplete runs are not in the sensitivity


@pytest.mark.parametrize(
    "summary, reason",
    [
        (b'{"norm": "rms", "seed": "zero"}', 'seed="zero" has the wrong type: it must be an integer'),
        (b'{"status": 3}', "status=3 has the wrong type: it must be a string"),
        (b'{"final_val_loss": [1]}', "final_val_loss=[1] has the wrong type"),
        (b'{"diverged_step": true}', "diverged_step=true has the wrong type"),
        (b'{"norm": "\xff\xfe"}', "unreadable ('utf-8' codec can't decode"),
        (b"[1, 2]", "not a JSON object"),
    ],
)
def test_a_damaged_summary_skips_its_run_with_a_note_or_gives_one_line(tmp_path, capsys, summary, reason):
    good = write_run(tmp_path / "sweep" / "good")
    bad = write_run(tmp_path / "sweep" / "bad", lr=1e-2)
    (bad / "summary.json").write_bytes(summary)
    report = (compare([str(tmp_path / "sweep")], out=tmp_path / "r") / "report.md").read_text()
    assert [r["run"] for r in table(report, "Runs")] == ["good"]
    assert f"skipped {bad / 'summary.json'}: {reason}" in report
    # alone, the damaged run is the command's one-line error
    assert run_compare_cli([str(bad), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("normlab: error: no readable runs: ") and reason in err
    assert "Traceback" not in err and good.exists()


def test_metrics_rows_of_the_wrong_type_or_invalid_utf8_are_counted_and_ignored(tmp_path):
    run_dir = write_run(tmp_path / "sweep" / "a", max_steps=8)
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": "nine", "loss": 1.0}\n')
        fh.write(b'{"step": 9, "loss": [1.0]}\n')
        fh.write(b'{"step": 9, "loss": \xff}\n')
        fh.write(b'["step", 9]\n')
    run = load_run(run_dir)
    assert run.bad_lines == 4 and run.last_step == 8
    report = (compare([str(tmp_path / "sweep")], out=tmp_path / "r") / "report.md").read_text()
    assert "a: 4 line(s) of metrics.jsonl were not readable rows" in report
    assert table(report, "Runs")[0]["final val loss"] == "3.0000"


@pytest.mark.parametrize("out", ["a_file", "a_file/report", "/proc/normlab-report"])
def test_a_report_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, out):
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "sweep" / "a")
    (tmp_path / "a_file").write_text("keep me")
    assert run_compare_cli(["sweep", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"normlab: error: --out {out}: cannot write the report there: "), err
    assert "choose another with --out DIR" in err
    assert (tmp_path / "a_file").read_text() == "keep me"


def _with_tokenizer(path: Path, tokenizer: str, bits_per_nat: float) -> Path:
    """Give a run written by write_run a tokenizer, and val_bpb = val_loss × bits_per_nat in its rows and summary."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").open()]
    for row in rows:
        if "val_loss" in row:
            row["val_bpb"] = row["val_loss"] * bits_per_nat
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((path / "summary.json").read_text())
    summary.update(tokenizer=tokenizer, final_val_bpb=summary["final_val_loss"] * bits_per_nat,
                   best_val_bpb=summary["best_val_loss"] * bits_per_nat)
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_compare_uses_bits_per_byte_when_the_runs_tokenizers_differ(tmp_path):
    # Per token the BPE run looks better (2.0 < 3.0); per byte the byte-level run is (3.0 × 0.5 < 2.0 × 1.2).
    _with_tokenizer(write_run(tmp_path / "s" / "byte", final=3.0, extra_config={"tokenizer.kind": "byte"}), "bytes-v1", 0.5)
    _with_tokenizer(write_run(tmp_path / "s" / "bpe", final=2.0, extra_config={"tokenizer.kind": "bpe"}), "bpe-4096-ab12", 1.2)
    comparison = build_comparison(find_run_dirs([tmp_path / "s"]))
    assert comparison.measure == "val_bpb"
    report = (compare([str(tmp_path / "s")], tmp_path / "report") / "report.md").read_text()
    assert "`bpe-4096-ab12`, `bytes-v1`" in report and "bits per byte" in report
    finals = {row["run"]: row["final val bits/byte"] for row in table(report, "Runs")}
    assert finals == {"byte": fmt(1.5), "bpe": fmt(2.4)}
    sensitivity = {row["arm"]: row["ℓ* (best)"] for row in table(report, "LR sensitivity")}
    assert sorted(sensitivity.values()) == [fmt(1.5), fmt(2.4)]


def test_compare_stays_in_nats_per_token_when_the_runs_share_a_tokenizer(tmp_path):
    _with_tokenizer(write_run(tmp_path / "s" / "a", final=3.0), "bpe-4096-ab12", 1.2)
    _with_tokenizer(write_run(tmp_path / "s" / "b", final=2.0, lr=3e-3), "bpe-4096-ab12", 1.2)
    assert build_comparison(find_run_dirs([tmp_path / "s"])).measure == "val_loss"
    report = (compare([str(tmp_path / "s")], tmp_path / "report") / "report.md").read_text()
    assert {row["run"]: row["final val loss"] for row in table(report, "Runs")} == {"a": fmt(3.0), "b": fmt(2.0)}
    assert "bits per byte" not in report
