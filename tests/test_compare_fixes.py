"""Tests for what a reviewer of `normlab compare` found wrong: common settings that list keys no run reads,
labels that spell out a model preset key by key, damaged summaries counted as runs, dashes without a
footnote, per-layer plots that switch scale, a loss plot cut to a sliver, and wall times that disagree."""

import json
from pathlib import Path

import pytest

from normlab.analysis import build_comparison, find_run_dirs
from normlab.analysis.compare import compare
from normlab.analysis.render.ranking import terminal_summary
from normlab.config import reads_key
from test_compare import run_compare_cli, table, write_run


def comparison_of(*paths: Path):
    return build_comparison(find_run_dirs(paths))


def common(comparison) -> dict:
    return dict(comparison.common)


def test_common_settings_leave_out_keys_no_compared_run_reads(tmp_path):
    for lr in (1e-3, 3e-3):
        write_run(tmp_path / f"none-{lr}", norm="none", lr=lr)
    shared = common(comparison_of(tmp_path))
    for unread in ("norm.eps", "mix_p", "data.split", "data.text_field", "data.val_split", "data.streaming",
                   "tokenizer.vocab_size", "qk_norm_axis", "qk_norm_gains"):
        assert unread not in shared, unread
    # what the runs do read stays
    assert shared["data.source"] == "stdlib" and shared["tokenizer.kind"] == "byte" and shared["qk_norm"] is False
    assert shared["placement"] == "pre" and shared["norm"] == "none"


def test_a_key_is_common_when_one_compared_run_reads_it(tmp_path):
    write_run(tmp_path / "mix", placement="mix", extra_config={"mix_p": 0.5, "tokenizer.kind": "bpe"})
    write_run(tmp_path / "pre", placement="pre", extra_config={"mix_p": 0.5, "tokenizer.kind": "bpe"})
    shared = common(comparison_of(tmp_path))
    assert shared["mix_p"] == 0.5 and shared["tokenizer.vocab_size"] == 4096


def test_runs_that_differ_only_in_a_key_their_choices_do_not_read_are_one_arm(tmp_path):
    write_run(tmp_path / "a", lr=1e-3, extra_config={"mix_p": 0.25})
    write_run(tmp_path / "b", lr=3e-3, extra_config={"mix_p": 0.5})
    comparison = comparison_of(tmp_path)
    assert [result.arm.label for result in comparison.arms] == ["rms-pre"]


@pytest.mark.parametrize(
    "settings, key, read",
    [
        ({"norm.name": "none", "qk_norm": False}, "norm.eps", False),
        ({"norm.name": "none", "qk_norm": True}, "norm.eps", True),
        ({"norm.name": "rms"}, "norm.bias", False),
        ({"norm.name": "layer"}, "norm.bias", True),
        ({"placement": "pre"}, "mix_p", False),
        ({"placement": "mix"}, "mix_p", True),
        ({"data.source": "text"}, "data.text_field", True),
        ({"data.source": "stdlib"}, "data.text_field", False),
        ({}, "data.split", True),  # an old run dir that records no choice
        ({"tokenizer.kind": "byte"}, "depth", True),
    ],
)
def test_reads_key_follows_the_runs_choices(settings, key, read):
    assert reads_key(settings, key) is read


def test_a_summary_whose_loss_is_not_a_number_is_skipped_with_a_note_on_the_terminal_too(tmp_path, capsys):
    for lr in (1e-3, 3e-3):
        write_run(tmp_path / "sweep" / f"good-{lr}", lr=lr)
    bad = write_run(tmp_path / "sweep" / "bad", lr=1e-2)
    summary = json.loads((bad / "summary.json").read_text())
    (bad / "summary.json").write_text(json.dumps({**summary, "final_val_loss": "abc"}))
    report = (compare([str(tmp_path / "sweep")], out=tmp_path / "r") / "report.md").read_text()
    assert sorted(r["run"] for r in table(report, "Runs")) == ["good-0.001", "good-0.003"]
    note = f"skipped {bad / 'summary.json'}: final_val_loss=\"abc\" is not a number"
    assert note in report
    assert run_compare_cli([str(tmp_path / "sweep"), "--out", str(tmp_path / "r2")]) == 0
    assert note in capsys.readouterr().out
    # "inf" and "nan", as metrics are written, stay numbers
    (bad / "summary.json").write_text(json.dumps({**summary, "final_val_loss": "nan", "status": "diverged"}))
    assert len(comparison_of(tmp_path / "sweep").runs) == 3


def test_a_dash_in_the_loss_spikes_column_has_a_footnote(tmp_path):
    write_run(tmp_path / "a", max_steps=8)  # 8 logged losses: too few to tell a spike
    lines = terminal_summary(comparison_of(tmp_path))
    row = lines[lines.index(next(line for line in lines if line.startswith("rank ") and "loss spikes" in line)) + 1]
    mark = row.rstrip()[-1]
    assert row.rstrip()[-2:] == "—" + mark and mark in "¹²³⁴⁵⁶⁷⁸⁹"
    footnote = next(line for line in lines if line.startswith(mark + " "))
    assert "loss spikes" in footnote and "20" in footnote


def test_the_job_line_and_the_runs_last_line_say_which_wall_time_each_counts(tmp_path, caplog):
    import logging

    from normlab.launch.sweep_log import job_line, sweep_table
    from normlab.train.callbacks.report import RunReport

    job = tmp_path / "3_rms-pre"
    job.mkdir()
    summary = {"name": "rms-pre", "status": "completed", "final_val_loss": 2.5, "final_val_bpb": 3.6,
               "best_val_loss": 2.5, "best_val_bpb": 3.6, "tokens_per_s": 1000.0, "wall_time_s": 42.3}
    (job / "summary.json").write_text(json.dumps(summary))
    line = job_line(job)
    assert "run wall time 42.3 s (set-up included)" in line
    assert "run wall s" in sweep_table(tmp_path).splitlines()[1]
    with caplog.at_level(logging.INFO, logger="normlab"):
        RunReport("rms-pre", "fp32", str(job)).on_train_end(None, summary)
    assert "training loop " in caplog.text and "s (set-up not included)" in caplog.text


def drawn_axes(comparison, tmp_path, monkeypatch) -> dict:
    """{file: [axes]} of every plot write_plots draws."""
    from normlab.analysis.render import figures
    from normlab.analysis.render.plots import write_plots

    drawn = {}
    save = figures.Grid.save

    def keep(grid, path):
        drawn[Path(path).name] = grid.axes
        save(grid, path)

    monkeypatch.setattr(figures.Grid, "save", keep)
    write_plots(comparison, tmp_path)
    return drawn


def test_a_loss_curve_of_two_evaluations_is_drawn_whole_not_cut_to_a_sliver(tmp_path, monkeypatch):
    run = write_run(tmp_path / "runs" / "a", max_steps=100, init=5.5, final=3.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # evaluations at the first and the last step only
        if row["step"] not in (0, 100):
            row.pop("val_loss", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    drawn = drawn_axes(comparison_of(tmp_path / "runs"), tmp_path, monkeypatch)
    low, high = drawn["loss_val.png"][0].get_ylim()
    assert low < 3.0 and high > 5.5  # both evaluations on the axis: a line across it, not a sliver at its end
    assert drawn["loss_train.png"][0].get_ylim()[1] < 5.5  # a curve of many points still shows its late part only


def test_the_per_layer_plots_use_one_y_scale_on_every_panel(tmp_path, monkeypatch):
    write_run(tmp_path / "runs" / "a", lr=1e-3, depth=2, telemetry=True)
    wide = write_run(tmp_path / "runs" / "b", lr=1e-2, depth=2, telemetry=True)
    rows = [json.loads(line) for line in (wide / "metrics.jsonl").read_text().splitlines()]
    last = max(i for i, row in enumerate(rows) if "grad/norm/L01" in row)
    rows[last]["grad/norm/L01"] = 1000 * rows[last]["grad/norm/L00"]  # this panel alone spans 3 decades
    (wide / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    axes = drawn_axes(comparison_of(tmp_path / "runs"), tmp_path, monkeypatch)["layers_grad_norm.png"]
    assert len(axes) == 3 and {ax.get_yscale() for ax in axes} == {"log"}


TINY = {"depth": 2, "seq_len": 64, "model.d_model": 32, "model.n_head": 2, "model.context": 64}
SMALL = {"depth": 4, "seq_len": 128, "model.d_model": 128, "model.n_head": 4, "model.context": 128}


def test_arms_that_differ_by_model_preset_are_labelled_by_its_name(tmp_path):
    for preset, keys in (("tiny", TINY), ("small", SMALL)):
        for norm in ("rms", "layer"):
            write_run(tmp_path / f"{preset}-{norm}", norm=norm, depth=keys["depth"], extra_config={**keys, "max_steps": 8 if preset == "tiny" else 12})
    labels = sorted(result.arm.label for result in comparison_of(tmp_path).arms)
    assert labels == ["layer model=small max_steps=12", "layer model=tiny max_steps=8",
                      "rms model=small max_steps=12", "rms model=tiny max_steps=8"]


def test_a_run_that_matches_no_preset_keeps_its_keys_in_the_label(tmp_path):
    write_run(tmp_path / "tiny", depth=2, extra_config=TINY)
    write_run(tmp_path / "wide", depth=2, extra_config={**TINY, "model.d_model": 48})
    labels = sorted(result.arm.label for result in comparison_of(tmp_path).arms)
    assert labels == ["model.d_model=32", "model.d_model=48"]


def test_the_terminal_table_fits_120_columns_whatever_its_columns_and_labels():
    from normlab.analysis.render.terminal import fitted

    head = ["rank", "arm", *(f"column {i}" for i in range(12))]
    rows = [[str(r), f"arm {r}", *(f"{r}.{i:08d}" for i in range(12))] for r in (1, 2)]
    lines = fitted(head, rows)
    assert max(map(len, lines)) <= 120
    blocks = [line for line in lines if line.startswith("rank")]
    assert len(blocks) == 2 and all(line.split()[:2] == ["rank", "arm"] for line in blocks)
    assert sum(line.count("column") for line in blocks) == 12  # every column once
    long = [[str(r), f"rms-pre model=small max_steps=500 {'x' * 30}{r}", "2.5"] for r in (1, 2)]
    lines = fitted(["rank", "arm", "loss"], long)
    assert lines[1].split() == ["1", "A1", "2.5"] and lines[-2:] == [f"A1  {long[0][1]}", f"A2  {long[1][1]}"]


def test_the_ranked_table_on_the_terminal_is_within_120_columns(tmp_path):
    for preset, keys in (("tiny", TINY), ("small", SMALL)):
        for lr in (1e-3, 3e-3):
            write_run(tmp_path / f"{preset}-{lr}", lr=lr, depth=keys["depth"], extra_config={**keys, "max_steps": 500})
    lines = terminal_summary(comparison_of(tmp_path))
    table_lines = lines[2:lines.index(next(line for line in lines if line.startswith("Common settings"))) - 1]
    assert max(map(len, table_lines)) <= 120 and sum(line.startswith("rank") for line in table_lines) >= 2
