"""Tests for what `normlab compare` answers first: arms labelled by what differs, the ranked table (in
report.md and on the terminal), seeds, stability, runs that did not start, metrics.csv, and the
environment warning; on a mixed set of written run dirs and one real tiny run."""

import csv
import json
import math
import re
import warnings
from pathlib import Path

import pytest

from normlab import cli
from normlab.analysis import build_comparison, find_run_dirs, load_run
from normlab.analysis.compare import compare
from normlab.analysis.stats.stability import SPIKE_WINDOW, run_stability, spike_steps
from normlab.config import RunConfig, nest_config
from normlab.train.sinks import MetricsCsv
from test_compare import PNG_MAGIC, table, write_run

ENV = {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "device": "cpu", "torch_threads": 2, "world_size": 1,
       "normlab": "0.1.0", "git_commit": None}  # fmt: skip


def set_summary(run_dir: Path, **values) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(values)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def to_csv_only(run_dir: Path) -> Path:
    """Rewrite the run's metrics.jsonl as the csv sink would have written it, and drop the jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with open(run_dir / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, MetricsCsv.COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: v for k, v in row.items() if v is not None} for row in rows)
    (run_dir / "metrics.jsonl").unlink()
    return run_dir


def not_started(run_dir: Path, error: str, **settings) -> Path:
    """A run that failed before its first step: config.json and a failed summary.json, no metrics."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(nest_config(settings, into=RunConfig().to_dict())))
    (run_dir / "summary.json").write_text(json.dumps({"status": "failed", "error": error, "steps": 0}))
    return run_dir


@pytest.fixture
def mixed(tmp_path) -> Path:
    """Two widths × {rms, layer}, two seeds of one arm, one single-lr arm read from metrics.csv alone, one
    run that did not start; placement=pre everywhere."""
    sweep = tmp_path / "mixed"
    for lr, final in ((1e-3, 3.0), (3e-3, 2.9)):
        for seed in (0, 1):
            run = write_run(sweep / f"rms64-{lr}-{seed}", lr=lr, seed=seed, final=final + seed / 10,
                            extra_config={"model.d_model": 64})
            set_summary(run, environment={**ENV, "torch_threads": 1 + seed})  # the arm's seeds differ in threads
        write_run(sweep / f"rms128-{lr}", lr=lr, final=final - 0.4, extra_config={"model.d_model": 128})
        set_summary(sweep / f"rms128-{lr}", environment=ENV)
        write_run(sweep / f"layer128-{lr}", norm="layer", lr=lr, final=final - 0.2, extra_config={"model.d_model": 128})
    to_csv_only(write_run(sweep / "layer64-csv", norm="layer", lr=3e-3, final=3.2, extra_config={"model.d_model": 64}))
    not_started(sweep / "batch64-offline", "DataError: offline:\nno cached copy of roneneldan/TinyStories",
                **{"norm.name": "batch", "model.d_model": 64, "seed": 7})
    return sweep


def test_arms_are_labelled_by_what_varies_and_the_rest_is_one_common_line(mixed):
    comparison = build_comparison(find_run_dirs([mixed]))
    assert comparison.dims == ["norm", "model.d_model"]
    assert [r.arm.label for r in comparison.ranked] == [
        "rms model.d_model=128", "layer model.d_model=128", "rms model.d_model=64", "layer model.d_model=64"]
    common = dict(comparison.common)
    assert common["placement"] == "pre" and common["depth"] == 2 and common["max_steps"] == 8
    assert "norm" not in common and "model.d_model" not in common and "lr" not in common  # they vary
    assert "log_every" not in common and "wandb.mode" not in common  # bookkeeping
    # the run that did not start (norm=batch, seed=7) neither adds an arm nor makes norm or seed vary
    assert "seed" not in common  # seeds 0 and 1 vary
    report = (compare([str(mixed)], out=mixed / "report") / "report.md").read_text()
    line = next(line for line in report.splitlines() if line.startswith("Common settings (every run): "))
    assert "placement=pre" in line and "depth=2" in line and "model.d_model" not in line and " norm=" not in line


def test_report_opens_with_the_ranked_table_and_the_single_lr_arm_has_no_sensitivity(mixed):
    report = (compare([str(mixed)], out=mixed / "report") / "report.md").read_text()
    headings = re.findall(r"^## (.+)$", report, flags=re.M)
    assert headings[0] == "Ranking" and headings.index("Runs") > headings.index("Did not start") > 0
    assert report.splitlines()[2] == ("**Best: rms model.d_model=128 at lr=3e-3, final val loss 2.5000 (1 seed). No "
                                      "interval for its gap to layer model.d_model=128: rms model.d_model=128 and layer "
                                      "model.d_model=128 ran one seed; add seeds.**")
    first_table = next(line for line in report.splitlines() if line.startswith("|"))
    assert first_table.split("|")[1].strip() == "rank"
    rows = table(report, "Ranking")
    assert [(r["rank"], r["arm"]) for r in rows] == [
        ("1", "rms model.d_model=128"), ("2", "layer model.d_model=128"), ("3", "rms model.d_model=64"),
        ("4", "layer model.d_model=64")]  # fmt: skip
    rms64 = rows[2]
    assert (rms64["final val loss"], rms64["seeds"], rms64["best lr"]) == ("2.9500 ± 0.0707", "2", "3e-3 (largest)")
    assert rms64["diverged/failed"] == "0 of 4" and rms64["max grad norm"] == "1.5"
    # no telemetry; 8 losses are too few: dashes with a footnote mark
    assert re.fullmatch("—[¹²³⁴⁵⁶⁷⁸⁹]", rms64["max attn logit"]) and re.fullmatch("—[¹²³⁴⁵⁶⁷⁸⁹]", rms64["loss spikes"])
    assert rows[0]["LR sensitivity"] != "—" and re.fullmatch(r"\d\.\d{4}", rows[0]["LR sensitivity"])
    single = rows[3]
    assert re.fullmatch("—[¹²³⁴⁵⁶⁷⁸⁹]", single["LR sensitivity"]) and single["best lr"] == "3e-3 (only)"
    mark = single["LR sensitivity"][-1]
    assert f"{mark} LR sensitivity: it needs at least two learning rates; the arm ran one (lr=3e-3)." in report
    assert "0.0000" not in single["LR sensitivity"]


def test_the_terminal_shows_the_ranked_table_the_warnings_and_the_path(mixed, capsys):
    assert cli.main(["compare", str(mixed), "--out", str(mixed / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("9 runs in 4 arms. Best: rms model.d_model=128 at lr=3e-3, final val loss 2.5000 (1 seed). "
                               "No interval for its gap to layer model.d_model=128:")
    assert lines[2].startswith("rank  arm ")
    assert [line.split("  ")[0] for line in lines[3:7]] == ["1", "2", "3", "4"]
    assert re.fullmatch(r"4\s+layer model\.d_model=64\s+3\.2000\s+1\s+3e-3 \(only\)\s+\+0\.7000\s+1 seed: no interval\s+—",
                        lines[6]), lines[6]  # the first block ends with vs best; the second repeats rank and arm
    fourth = [line for line in lines if line.startswith("4  ")]
    assert len(fourth) == 2 and max(len(line) for line in lines[2:lines.index(fourth[1]) + 1]) <= 120
    found = re.match(r"4\s+layer model\.d_model=64\s+—([¹²³⁴⁵⁶⁷⁸⁹])\s", fourth[1])
    assert found, fourth[1]
    assert any(line.startswith(f"{found[1]} LR sensitivity: it needs at least two learning rates") for line in lines)
    warned = [line for line in lines if line.startswith("warning: ")]
    assert warned == ["warning: rms model.d_model=64: its runs ran in different environments (torch_threads 1 vs 2): "
                      "their numbers may differ for that alone"]
    assert [line for line in lines if line.startswith("did not start: ")] == [
        "did not start: batch64-offline: DataError: offline: no cached copy of roneneldan/TinyStories"]
    assert lines[-1] == f"report: {mixed / 'r' / 'report.md'}"


def test_a_run_that_never_trained_is_listed_once_under_did_not_start(mixed):
    comparison = build_comparison(find_run_dirs([mixed]))
    assert [run.path.name for run in comparison.not_started] == ["batch64-offline"]
    assert all(run.path.name != "batch64-offline" for run in comparison.runs)
    report = (compare([str(mixed)], out=mixed / "report") / "report.md").read_text()
    assert report.count("batch64-offline") == 1
    assert "- `batch64-offline`: DataError: offline: no cached copy of roneneldan/TinyStories" in report
    assert "batch64-offline" not in {r["run"] for r in table(report, "Runs")}
    # a run that failed after it trained is still an arm's run, with its error under Runs
    write_run(mixed / "layer64-oom", norm="layer", lr=1e-3, status="failed", error="RuntimeError: out of memory",
              extra_config={"model.d_model": 64})
    report = (compare([str(mixed)], out=mixed / "report") / "report.md").read_text()
    assert {r["run"]: r["status"] for r in table(report, "Runs")}["layer64-oom"] == "failed"


def test_only_not_started_runs_give_a_report_that_says_so(tmp_path):
    not_started(tmp_path / "s" / "a", "TokenizerError: tokenizer.name=nope: not found")
    report = (compare([str(tmp_path / "s")], out=tmp_path / "r") / "report.md").read_text()
    assert "No run trained: every run failed before its first step" in report
    assert "- `a`: TokenizerError: tokenizer.name=nope: not found" in report


def test_a_csv_only_run_is_read_like_its_jsonl(tmp_path):
    jsonl = write_run(tmp_path / "a", lr=1e-3, status="diverged", diverged_step=5)
    csv_run = to_csv_only(write_run(tmp_path / "b", lr=1e-3, status="diverged", diverged_step=5))
    left, right = load_run(jsonl), load_run(csv_run)
    assert right.metrics_file == "metrics.csv" and left.metrics_file == "metrics.jsonl"
    for key in ("loss", "val_loss", "grad_norm", "lr", "tokens"):
        assert right.curve(key) == left.curve(key), key
    assert right.diverged_step == 5 and right.rows[-1]["status"] == "diverged"
    with open(csv_run / "metrics.csv", "a") as fh:
        fh.write("9,2304,1.5\n")  # cut short by a kill
        fh.write("10,2560,x,,,,,,\n")  # not a number
    assert load_run(csv_run).bad_lines == 2
    report = (compare([str(csv_run)], out=tmp_path / "r") / "report.md").read_text()
    assert "b: 2 line(s) of metrics.csv were not readable rows (torn, not UTF-8 CSV, or of the wrong types)" in report


def test_seeds_are_drawn_as_mean_and_band_and_no_layout_warning(mixed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compare([str(mixed)], out=mixed / "report")
    assert not [w for w in caught if "layout" in str(w.message)], [str(w.message) for w in caught]
    for name in ("loss_train.png", "loss_val.png", "final_val_loss_vs_lr.png", "stability.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_seed_band_is_the_mean_and_range_of_the_seeds_at_each_step():
    from normlab.analysis.render.plots import seed_band

    steps, mean, low, high = seed_band([([0, 1, 2], [3.0, 2.0, 1.0]), ([0, 1], [5.0, 4.0])])
    assert steps.tolist() == [0, 1, 2]
    assert mean.tolist() == [4.0, 3.0, 1.0] and low.tolist() == [3.0, 2.0, 1.0] and high.tolist() == [5.0, 4.0, 1.0]


# ------------------------------------------------------------------------------------------ stability


def test_spikes_are_losses_k_running_stds_above_the_running_mean():
    flat = [3.0 + 0.01 * (-1) ** i for i in range(40)]
    steps = list(range(0, 400, 10))
    assert spike_steps(steps, flat) == []
    spiked = [*flat[:25], 3.5, *flat[26:]]
    assert spike_steps(steps, spiked) == [250]  # the window after it holds the spike: no echo
    assert spike_steps(steps, spiked, k=60.0) == []  # 3.5 is 50 stds above 3.0 ± 0.01
    early = [*flat[:5], 9.0, *flat[6:]]
    assert spike_steps(steps, early) == []  # before a full window nothing is judged
    assert spike_steps(steps, [3.0] * 40) == []  # no spread: nothing is a spike
    falling = [5.0 - 0.05 * i for i in range(40)]
    assert spike_steps(steps, falling) == []  # a falling loss is never above its running mean


def test_stability_figures_of_a_run_and_its_arm(tmp_path):
    run_dir = write_run(tmp_path / "s" / "a", max_steps=2 * SPIKE_WINDOW + 4, telemetry=True, depth=3)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "loss" in row:
            row["loss"] = 3.0 + 0.01 * (-1) ** row["step"] + (1.0 if row["step"] == 30 else 0.0)
        if row["step"] % 2 == 0 and row["step"] < 2 * SPIKE_WINDOW + 4:
            row.update({f"attn/logit_max/L{i:02d}": 10.0 * i + row["step"] for i in range(3)})
    rows[7]["grad_norm"] = 42.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures = run_stability(load_run(run_dir))
    assert figures.max_grad_norm == 42.0 and figures.spikes == 1
    assert figures.max_attn_logit == 20.0 + 2 * SPIKE_WINDOW + 2  # layer 2 at the last telemetry step
    write_run(tmp_path / "s" / "b", lr=1e-2, max_steps=2 * SPIKE_WINDOW + 4, depth=3)
    [arm] = build_comparison(find_run_dirs([tmp_path / "s"])).arms
    assert (arm.stability.spikes, arm.stability.runs_with_spikes, arm.stability.runs_checked) == (1, 1, 2)
    report = (compare([str(tmp_path / "s")], out=tmp_path / "r") / "report.md").read_text()
    [row] = table(report, "Ranking")
    assert (row["max grad norm"], row["max attn logit"], row["loss spikes"]) == ("42", "62", "1 (1 of 2 runs)")
    assert "by more than 6 of their standard deviations (OLMo-core's StabilityMonitorCallback rule" in report
    assert "Common settings (every run): `norm=rms` `placement=pre` " in report  # one arm: its norm is common


# ------------------------------------------------------------------------------------------ environment


def test_environment_differences_warn_once_per_arm_and_runs_without_the_block_are_not_compared(tmp_path):
    sweep = tmp_path / "s"
    set_summary(write_run(sweep / "a", lr=1e-3), environment=ENV)
    set_summary(write_run(sweep / "b", lr=1e-2), environment={**ENV, "device": "NVIDIA H100", "cuda": "12.8"})
    write_run(sweep / "c", lr=3e-2)  # written before the block existed: nothing to compare
    set_summary(write_run(sweep / "d", norm="layer", lr=1e-3), environment=ENV)
    write_run(sweep / "e", norm="layer", lr=1e-2)
    comparison = build_comparison(find_run_dirs([sweep]))
    assert comparison.environment_warnings == [
        "rms: its runs ran in different environments (cuda None vs 12.8; device cpu vs NVIDIA H100): their numbers "
        "may differ for that alone"]
    report = (compare([str(sweep)], out=tmp_path / "r") / "report.md").read_text()
    assert "## Warnings\n\n- rms: its runs ran in different environments (cuda None vs 12.8;" in report


# ------------------------------------------------------------------------------------------ a real run


def test_a_real_runs_csv_holds_every_run_level_key_and_compare_reads_it(tmp_path):
    from conftest import tiny_config
    from normlab.train.run import train

    cfg = tiny_config("rms", "pre", max_steps=4, eval_every=2)
    cfg.wandb.mode, cfg.sinks = "disabled", ["jsonl", "csv"]
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    run_level = {key for record in records for key in record if "/" not in key}
    assert run_level <= set(MetricsCsv.COLUMNS) and "val_bpb" in run_level
    from_jsonl = load_run(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    from_csv = load_run(tmp_path / "run")
    assert from_csv.metrics_file == "metrics.csv"
    for key in run_level - {"step"}:
        steps, values = from_jsonl.curve(key)
        assert from_csv.curve(key)[0] == steps and from_csv.curve(key)[1] == pytest.approx(values, rel=1e-12), key
    assert math.isfinite(from_csv.init_loss) and from_csv.init_loss == from_jsonl.init_loss


def test_compare_bench_writes_realistic_runs_and_times_compare(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "compare.py"
    out = subprocess.run([sys.executable, str(script), "--grid", "norm=none,rms lr=1e-3,1e-1 seed=0,1", "--steps", "60",
                          "--repeats", "1", "--keep", str(tmp_path / "runs")], capture_output=True, text=True, check=True).stdout
    assert out.startswith("8 run dirs, ")
    wall, cpu = map(float, re.search(r"normlab compare: ([\d.]+) s wall .*, ([\d.]+) s CPU", out).groups())
    assert wall > 0 and cpu > 0
    comparison = build_comparison(find_run_dirs([tmp_path / "runs"]))
    assert [r.arm.label for r in comparison.arms] == ["none", "rms"]
    assert {run.status for run in comparison.runs} == {"completed", "diverged"}  # none at lr 1e-1 diverges
    assert all(run.has_layer_stat("attn/logit_max") and run.environment for run in comparison.runs)
