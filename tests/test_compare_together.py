"""Tests where the verdict's parts (gaps, intervals, repeats, bracketing, factor effects) meet the exports,
the terminal's 120-column blocks and notes, and config.reads_key (keys a run does not read)."""

import json

from scipy import stats

from normlab.analysis import build_comparison, find_run_dirs
from normlab.analysis.render.exports import arm_records, csv_text
from normlab.analysis.render.ranking import terminal_summary
from normlab.analysis.render.terminal import fitted
from test_compare import write_run


def comparison_of(path):
    return build_comparison(find_run_dirs([path]))


def test_arms_exports_hold_the_gap_and_its_interval_as_numbers(tmp_path):
    finals = {"rms": (3.00, 3.01, 3.02), "layer": (3.05, 3.07, 3.06), "batch": (3.5,)}
    for norm, losses in finals.items():
        for seed, final in enumerate(losses):
            write_run(tmp_path / f"{norm}-{seed}", norm=norm, lr=3e-3, seed=seed, final=final)
    records = {r["arm"]: r for r in arm_records(comparison_of(tmp_path))}
    want = stats.ttest_rel([3.05, 3.07, 3.06], [3.00, 3.01, 3.02]).confidence_interval()
    layer = records["layer"]
    assert abs(layer["gap to best"] - 0.05) < 1e-9 and "95% interval" not in layer
    assert abs(layer["95% interval low"] - want.low) < 1e-9 and abs(layer["95% interval high"] - want.high) < 1e-9
    assert (layer["gap kind"], layer["gap n"], layer["vs best"]) == ("paired", 3, "worse")
    batch, best = records["batch"], records["rms"]
    assert abs(batch["gap to best"] - 0.49) < 1e-9 and batch["95% interval low"] is None and batch["gap n"] == 1
    assert best["gap to best"] == 0.0 and best["95% interval high"] is None
    json.dumps(list(records.values()), allow_nan=False)  # numbers, no NaN
    head = csv_text(list(records.values())).splitlines()[0].split(",")
    assert "95% interval low" in head and "95% interval high" in head and "95% interval" not in head


def test_a_gap_its_interval_and_verdict_stay_in_one_block_of_the_terminal_table(tmp_path):
    head = ["rank", "arm", "a" * 50, "gap to best", "95% interval", "vs best", "b" * 10]
    rows = [["1", "x", "1", "+0.1", "[−0.0557, +0.0757] 3 paired seeds", "within noise", "2"]]
    lines = fitted(head, rows, together=((3, 4, 5),))
    blocks = [line.split() for line in lines if line.startswith("rank")]
    assert blocks[0][2:] == ["a" * 50] and blocks[1][2:5] == ["gap", "to", "best"] and "noise" in lines[-1]
    # without the group the greedy fill would have put the gap beside the first column and split it
    assert [line.split() for line in fitted(head, rows) if line.startswith("rank")][0][2:6] == ["a" * 50, "gap", "to", "best"]
    for norm in ("rms", "layer"):
        for seed in (0, 1):
            write_run(tmp_path / f"{norm}-{seed}", norm=norm, lr=3e-3, seed=seed, final=3.0 + seed / 50,
                      extra_config={"model.d_model": 128, "optim.warmup_steps": 7 + seed % 1})
    lines = terminal_summary(comparison_of(tmp_path))
    heads = [line for line in lines if line.startswith("rank  arm")]
    assert sum("gap to best" in h for h in heads) == 1
    assert all(("95% interval" in h) == ("gap to best" in h) == ("vs best" in h) for h in heads)


def test_runs_differing_only_in_a_key_they_do_not_read_are_one_training_counted_once(tmp_path):
    # mix_p under placement=pre changes nothing: rms-a and rms-b are one training at one seed
    write_run(tmp_path / "rms-a", lr=3e-3, seed=0, final=3.0, extra_config={"mix_p": 0.3})
    write_run(tmp_path / "rms-b", lr=3e-3, seed=0, final=3.0, extra_config={"mix_p": 0.7})
    write_run(tmp_path / "rms-c", lr=3e-3, seed=1, final=3.1, extra_config={"mix_p": 0.3})
    for seed in (0, 1):
        write_run(tmp_path / f"layer-{seed}", norm="layer", lr=3e-3, seed=seed, final=3.2 + seed / 10,
                  extra_config={"mix_p": 0.3})
    comparison = comparison_of(tmp_path)
    assert [(a.arm.label, len(a.runs)) for a in comparison.arms] == [("layer", 2), ("rms", 2)]
    assert comparison.gaps[comparison.ranked[1].arm].n == 2  # 2 paired seeds, not 3 runs
    assert any("rms-b: the same training as rms-a (it does not read mix_p): counted once" in n for n in comparison.notes)
    assert all("mix_p" not in effect.factor for effect in comparison.effects)


def test_a_key_nobody_reads_is_no_factor(tmp_path):
    for norm in ("rms", "layer"):
        for placement in ("pre", "post"):
            for seed in (0, 1):
                write_run(tmp_path / f"{norm}-{placement}-{seed}", norm=norm, placement=placement, lr=3e-3, seed=seed,
                          final=3.0 + (norm == "layer") / 10 + (placement == "post") / 20 + seed / 100,
                          extra_config={"mix_p": 0.3 if norm == "rms" else 0.7})  # read by no run (no placement=mix)
    comparison = comparison_of(tmp_path)
    assert [effect.factor for effect in comparison.effects] == ["norm", "placement"]
    lines = terminal_summary(comparison)
    assert [line.split(":")[0].strip() for line in lines if line.startswith("  ") and " best;" in line] == ["norm", "placement"]


def test_bracketing_notes_and_skip_notes_both_reach_the_terminal(tmp_path):
    for lr, final in ((1e-3, 3.1), (3e-3, 3.0)):
        write_run(tmp_path / f"rms-{lr}", lr=lr, final=final)
    bad = write_run(tmp_path / "bad", lr=1e-2)
    summary = json.loads((bad / "summary.json").read_text())
    (bad / "summary.json").write_text(json.dumps({**summary, "final_val_loss": "abc"}))
    lines = terminal_summary(comparison_of(tmp_path))
    assert "note: rms-pre: best lr 3e-3 is the largest run; add lr=1e-2" in lines
    skipped = f"skipped {bad / 'summary.json'}: final_val_loss=\"abc\" is not a number"
    assert any(line.startswith(skipped) for line in lines)
