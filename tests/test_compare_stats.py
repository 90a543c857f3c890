"""Tests for how sure `normlab compare` is: gaps to the best arm with 95% intervals (checked against
scipy.stats), repeated runs counted once, lr bracketing, factor effects and the scale plot; on run dirs
written with known final losses."""

import json
import os
import shutil
from pathlib import Path

import pytest
from scipy import stats

from normlab.analysis import build_comparison, find_run_dirs
from normlab.analysis.stats.bracketing import rounded
from normlab.analysis.stats.intervals import mean_interval, paired, welch
from normlab.analysis.render.plots import Plot
from normlab.analysis.render.ranking import terminal_summary
from normlab.analysis.render.report import write_report
from normlab.analysis.render.scale_plot import draw_scale, scale_dims
from test_compare import PNG_MAGIC, table, write_run


def comparison_of(path: Path):
    return build_comparison(find_run_dirs([path]))


def report_of(path: Path) -> str:
    """report.md of the runs under `path`, without drawing the plots (fast)."""
    (path / "report").mkdir(exist_ok=True)
    return write_report(comparison_of(path), path / "report", [], [str(path)]).read_text()


def arm_row(report: str, arm: str) -> dict[str, str]:
    return next(row for row in table(report, "Ranking") if row["arm"] == arm)


# ------------------------------------------------------------------------------------------ intervals


def test_intervals_match_scipy_stats():
    a, b = [3.05, 3.07, 3.06, 3.10], [3.00, 3.01, 3.02, 3.03]
    got = paired(dict(enumerate(a)), dict(enumerate(b)))
    want = stats.ttest_rel(a, b).confidence_interval()
    assert (got.kind, got.n) == ("paired", 4)
    assert got.diff == pytest.approx(sum(a) / 4 - sum(b) / 4)
    assert (got.low, got.high) == pytest.approx((want.low, want.high))
    c = [2.9, 3.2, 3.0]
    got = welch(c, b)
    want = stats.ttest_ind(c, b, equal_var=False).confidence_interval()
    assert (got.kind, got.n, got.n_other) == ("Welch", 3, 4)
    assert (got.low, got.high) == pytest.approx((want.low, want.high))
    diffs = [0.01, 0.03, -0.005]
    want = stats.ttest_1samp(diffs, 0).confidence_interval()
    assert (mean_interval(diffs).low, mean_interval(diffs).high) == pytest.approx((want.low, want.high))
    assert not mean_interval([0.2]).has_interval and not welch([3.0], b).has_interval
    assert paired({0: 3.0, 1: 3.1}, {1: 3.0, 2: 2.9}).n == 1  # one shared seed: no paired interval


# ------------------------------------------------------------------------------------------ gaps to the best


@pytest.fixture
def seeded(tmp_path) -> Path:
    """rms (3 seeds), layer (3 seeds, clearly worse), dyt (3 seeds, within noise of rms), batch (1 seed);
    placement=pre, lrs 1e-3 and 3e-3 (the worse lr 0.2 higher)."""
    finals = {"rms": (3.00, 3.01, 3.02), "layer": (3.05, 3.07, 3.06), "dyt": (3.03, 2.99, 3.04), "batch": (3.5,)}
    for norm, losses in finals.items():
        for seed, final in enumerate(losses):
            for lr, worse in ((1e-3, 0.2), (3e-3, 0.0)):
                write_run(tmp_path / "s" / f"{norm}-{lr}-{seed}", norm=norm, lr=lr, seed=seed, final=final + worse)
    return tmp_path / "s"


def test_the_ranked_table_gives_each_arms_gap_to_the_best_with_its_interval(seeded):
    report = report_of(seeded)
    best, layer, dyt, batch = (arm_row(report, arm) for arm in ("rms", "layer", "dyt", "batch"))
    assert (best["rank"], best["gap to best"], best["vs best"]) == ("1", "best", "—")
    want = stats.ttest_rel([3.05, 3.07, 3.06], [3.00, 3.01, 3.02]).confidence_interval()
    assert layer["gap to best"] == "+0.0500"
    assert layer["95% interval"] == f"[{want.low:+.4f}, {want.high:+.4f}] 3 paired seeds"
    assert layer["vs best"] == "worse"
    assert dyt["gap to best"] == "+0.0100" and dyt["vs best"] == "within noise"
    assert batch["95% interval"] == "1 seed: no interval" and batch["vs best"] == "—"


def test_the_answer_says_how_sure_and_a_note_says_the_seed_counts_differ(seeded):
    lines = terminal_summary(comparison_of(seeded))
    assert lines[0].endswith("The top 2 arms are within noise of rms (95% intervals of their gaps cover 0): add seeds.")
    assert any(line.startswith("note: The arms ran different numbers of seeds at their best lr (3 seeds: rms, dyt, "
                               "layer; 1 seed: batch)") for line in lines)


def test_a_clear_winner_is_said_with_its_paired_interval(seeded):
    for run in seeded.glob("dyt-*"):
        shutil.rmtree(run)
    report = report_of(seeded)
    want = stats.ttest_rel([3.05, 3.07, 3.06], [3.00, 3.01, 3.02]).confidence_interval()
    assert report.splitlines()[2] == (f"**Best: rms at lr=3e-3, final val loss 3.0100 (3 seeds). rms beats layer by 0.0500 "
                                      f"[{want.low:+.4f}, {want.high:+.4f}], 3 paired seeds.**")


def test_arms_without_shared_seeds_are_compared_by_welch(tmp_path):
    for seed, final in ((0, 3.0), (1, 3.02)):
        write_run(tmp_path / f"rms-{seed}", lr=3e-3, seed=seed, final=final)
    for seed, final in ((5, 3.2), (6, 3.25), (7, 3.21)):
        write_run(tmp_path / f"layer-{seed}", norm="layer", lr=3e-3, seed=seed, final=final)
    comparison = comparison_of(tmp_path)
    gap = comparison.gaps[comparison.ranked[1].arm]
    want = stats.ttest_ind([3.2, 3.25, 3.21], [3.0, 3.02], equal_var=False).confidence_interval()
    assert (gap.kind, gap.n, gap.n_other) == ("Welch", 3, 2)
    assert (gap.low, gap.high) == pytest.approx((want.low, want.high))


# ------------------------------------------------------------------------------------------ repeated runs


def test_a_repeated_run_counts_once_the_newest_completed_with_one_note(tmp_path):
    write_run(tmp_path / "a", lr=3e-3, seed=0, final=2.40)
    write_run(tmp_path / "b", lr=3e-3, seed=0, final=2.38, extra_config={"log_every": 5})  # bookkeeping differs
    write_run(tmp_path / "c", lr=3e-3, seed=0, status="diverged", diverged_step=3)  # newest, but did not complete
    os.utime(tmp_path / "a" / "summary.json", (1e9, 1e9))
    os.utime(tmp_path / "b" / "summary.json", (2e9, 2e9))
    os.utime(tmp_path / "c" / "summary.json", (3e9, 3e9))
    write_run(tmp_path / "d", lr=3e-3, seed=1, final=2.50)  # another seed: no repeat
    comparison = comparison_of(tmp_path)
    assert sorted(run.path.name for run in comparison.runs) == ["b", "d"]
    assert comparison.caveats[0] == ("Repeated runs (the same config and seed, run again) count once, the newest "
                                     "completed one: b (kept; also a, c).")
    report = report_of(tmp_path)
    row = arm_row(report, "rms-pre")
    assert (row["final val loss"], row["seeds"]) == ("2.4400 ± 0.0849", "2")
    assert "b (kept; also a, c)" in report


# ------------------------------------------------------------------------------------------ lr bracketing


def test_a_best_lr_at_the_edge_of_the_grid_is_marked_with_the_lr_to_add(tmp_path):
    for lr, final in ((1e-3, 3.1), (3e-3, 3.0)):  # best at the largest
        write_run(tmp_path / f"layer-{lr}", norm="layer", lr=lr, final=final)
    for lr, final in ((1e-3, 2.9), (2e-3, 3.0), (4e-3, 3.1)):  # best at the smallest
        write_run(tmp_path / f"rms-{lr}", lr=lr, final=final)
    for lr, final in ((1e-3, 3.2), (3e-3, 3.0), (1e-2, 3.3)):  # bracketed
        write_run(tmp_path / f"dyt-{lr}", norm="dyt", lr=lr, final=final)
    write_run(tmp_path / "batch", norm="batch", lr=3e-3, final=3.4)  # one lr
    report = report_of(tmp_path)
    cells = {arm: arm_row(report, arm)["best lr"] for arm in ("layer", "rms", "dyt", "batch")}
    assert cells == {"layer": "3e-3 (largest)", "rms": "1e-3 (smallest)", "dyt": "3e-3", "batch": "3e-3 (only)"}
    assert "- layer: best lr 3e-3 is the largest run; add lr=1e-2" in report
    assert "- rms: best lr 1e-3 is the smallest run; add lr=5e-4" in report
    assert "- batch: ran one lr (3e-3), so the optimum is not bracketed; add a smaller and a larger lr" in report
    assert "- dyt:" not in report


def test_the_lr_to_add_is_one_grid_step_rounded_to_a_round_value_nearby():
    assert [rounded(x) for x in (9e-3, 3e-3 / 3, 1e-3 / 3, 8e-3, 3.3e-2)] == [1e-2, 1e-3, 3e-4, 8e-3, 3e-2]


# ------------------------------------------------------------------------------------------ factor effects


@pytest.fixture
def grid(tmp_path) -> Path:
    """norm (rms best by 0.02) × placement (pre best by 0.05) × depth (4 best by 0.2), lr 1e-3/3e-3, 2 seeds,
    with an interaction (layer-post at depth 2 another 0.04 worse) so that the intervals are not points."""
    for norm in ("layer", "rms"):
        for placement in ("pre", "post"):
            for depth in (2, 4):
                for lr in (1e-3, 3e-3):
                    for seed in (0, 1):
                        final = (3.0 + 0.02 * (norm == "layer") + 0.05 * (placement == "post") + 0.2 * (depth == 2)
                                 + 0.04 * ((norm, placement, depth) == ("layer", "post", 2))
                                 + 0.1 * (lr == 1e-3) + 0.01 * seed)
                        write_run(tmp_path / "g" / f"{norm}-{placement}-{depth}-{lr}-{seed}", norm=norm,
                                  placement=placement, depth=depth, lr=lr, seed=seed, final=final)
    return tmp_path / "g"


def test_factor_effects_are_mean_differences_over_matched_settings(grid):
    comparison = comparison_of(grid)
    effects = {e.factor: e for e in comparison.effects}
    assert list(effects) == ["norm", "placement", "depth"]
    assert (effects["norm"].best, effects["placement"].best, effects["depth"].best) == ("rms", "pre", 4)
    layer = effects["norm"].levels[0]
    want = stats.ttest_1samp([0.02, 0.02, 0.02, 0.06], 0).confidence_interval()
    assert (layer.level, layer.effect.n) == ("layer", 4)
    assert layer.effect.diff == pytest.approx(0.03)
    assert (layer.effect.low, layer.effect.high) == pytest.approx((want.low, want.high))
    assert effects["depth"].levels[0].effect.diff == pytest.approx(0.21)
    out = "\n".join(terminal_summary(comparison))
    assert f"  norm: rms best; layer +0.0300 [{want.low:+.4f}, {want.high:+.4f}] (4 matched, within noise)" in out.replace("−", "-")
    assert "  depth: 4 best; 2 +0.2100 [+0.1782, +0.2418] (4 matched)" in out
    assert sum(line.startswith("  placement: pre best; post +0.0600 ") for line in out.splitlines()) == 1


def test_report_has_a_factor_table_and_a_norm_by_placement_pivot_per_depth(grid):
    report = report_of(grid)
    rows = table(report, "Factor effects")
    assert [(r["factor"], r["level"], r["minus the best level"], r["matched settings"], r["vs best level"]) for r in rows] == [
        ("norm", "rms (best)", "—", "—", "—"), ("norm", "layer", "+0.0300", "4", "within noise"),
        ("placement", "pre (best)", "—", "—", "—"), ("placement", "post", "+0.0600", "4", "worse"),
        ("depth", "4 (best)", "—", "—", "—"), ("depth", "2", "+0.2100", "4", "worse")]  # fmt: skip
    section = report.split("## Factor effects\n", 1)[1].split("\n## ", 1)[0]
    assert "Final val loss by norm × placement at depth=2 (best lr, seed mean):" in section
    depth2 = section.split("at depth=2", 1)[1]
    assert "| layer | 3.2250 | 3.3150 |" in depth2 and "| rms | 3.2050 | 3.2550 |" in depth2
    assert "| rms | 3.0050 | 3.0550 |" in section.split("at depth=4", 1)[1]


def test_one_varying_key_has_no_factor_section(seeded):
    assert comparison_of(seeded).effects == []
    assert "## Factor effects" not in report_of(seeded)


# ------------------------------------------------------------------------------------------ scale


def test_scale_plot_is_drawn_when_depth_varies_and_skipped_otherwise(grid, seeded, tmp_path):
    for run in grid.iterdir():
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "n_params": 1000 * summary["depth"]}))
    comparison = comparison_of(grid)
    assert scale_dims(comparison) == ["depth", "n_params"]
    plot = draw_scale(comparison, tmp_path / "scale.png", Plot("scale.png", "scale"))
    assert plot.skipped is None and (tmp_path / "scale.png").read_bytes()[:8] == PNG_MAGIC
    plot = draw_scale(comparison_of(seeded), tmp_path / "none.png", Plot("none.png", "scale"))
    assert plot.skipped == "neither depth, width nor the parameter count varies between the arms"
    assert not (tmp_path / "none.png").exists()
