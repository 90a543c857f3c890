"""The Python API (normlab.RunConfig, train_run, load_runs, compare) held to what the command line promises:
a finished run dir is left as it was, a config is checked before anything is made, and a damaged
record is skipped with a note, not a traceback."""

import json
import re

import pytest

from conftest import tiny_config
from normlab import RunConfig, compare, load_runs, train_run
from normlab.analysis import CompareError, SkippedRun
from normlab.config import ConfigError
from test_compare import write_run
from test_failures import snapshot


def test_train_run_into_a_finished_dir_returns_its_summary_and_changes_nothing(tmp_path, capsys, text_data):
    cfg = tiny_config("rms", max_steps=2, data=text_data, sinks=["jsonl"])
    first = train_run(cfg, tmp_path / "run")
    before = snapshot(tmp_path / "run")
    capsys.readouterr()
    again = train_run(tiny_config("rms", max_steps=2, data=text_data, sinks=["jsonl"], log_every=2), tmp_path / "run")
    assert again == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert again["wall_time_s"] == first["wall_time_s"] and again["status"] == "completed"
    assert snapshot(tmp_path / "run") == before  # no checkpoint, summary, normlab.log line or telemetry rewritten
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"normlab: rms-pre-d2-lr1e-3-s0 already completed in {tmp_path / 'run'}: "
                                         "not trained again (overwrite=true trains it afresh)\n")
    train_run(cfg, tmp_path / "run", echo=False)
    assert capsys.readouterr().err == "" and snapshot(tmp_path / "run") == before


@pytest.mark.parametrize("kwargs, says", [
    ({"lr": "x"}, "lr='x': must be a number"),
    ({"max_steps": 10.5}, "max_steps=10.5: must be an integer"),
    ({"progress": "yes"}, "progress='yes': must be true or false"),
])
def test_validate_checks_types_as_from_dict_does_and_train_run_makes_nothing_for_a_bad_config(tmp_path, kwargs, says):
    with pytest.raises(ConfigError) as by_hand:
        RunConfig(**kwargs).validate()
    with pytest.raises(ConfigError) as from_dict:
        RunConfig.from_dict(kwargs)
    assert str(by_hand.value) == str(from_dict.value) == says
    with pytest.raises(ConfigError, match="^" + says.replace(".", r"\.") + "$"):
        train_run(RunConfig(**kwargs), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_sub_config_given_by_hand_must_be_its_dataclass():
    with pytest.raises(ConfigError, match=r"^norm=rms: must be a NormConfig"):
        RunConfig(norm="rms").validate()


def _run_dir(path, summary_text, rows):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(summary_text)
    (path / "config.json").write_text(json.dumps({"norm": {"name": "rms"}, "placement": "pre", "lr": 1e-3}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_load_runs_skips_a_damaged_summary_with_a_note_and_returns_the_healthy_runs(tmp_path):
    rows = [{"step": 0, "loss": 5.0, "val_loss": 5.1}]
    _run_dir(tmp_path / "sweep" / "0_good", json.dumps({"status": "completed", "final_val_loss": 4.0}), rows)
    _run_dir(tmp_path / "sweep" / "1_bad", "{not json", rows)
    with pytest.warns(SkippedRun) as caught:
        runs = load_runs(tmp_path / "sweep")
    assert [run.path.name for run in runs] == ["0_good"] and runs[0].final_val_loss == 4.0
    [note] = [str(w.message) for w in caught]
    assert note.startswith(f"skipped {tmp_path / 'sweep' / '1_bad' / 'summary.json'}: unreadable (")
    with pytest.raises(CompareError, match="1_bad/summary.json: unreadable"):
        load_runs(tmp_path / "sweep", errors="raise")


def test_a_metrics_value_that_is_text_not_a_number_makes_its_row_unreadable(tmp_path):
    rows = [{"step": 0, "loss": 5.0}, {"step": 4, "loss": "inf", "grad_norm": "nan", "status": "diverged"},
            {"step": 8, "loss": "text"}, {"step": 9, "loss": 4.0, "lr": "1e-3"}]
    _run_dir(tmp_path / "run", json.dumps({"status": "completed"}), rows)
    [run] = load_runs(tmp_path / "run")
    assert [row["step"] for row in run.rows] == [0, 4, 9] and run.bad_lines == 1


def test_compare_of_no_path_says_so_and_of_one_path_takes_it_whole(tmp_path, monkeypatch):
    with pytest.raises(CompareError, match="^no path given: give a run dir, a sweep dir or the outputs/ root$"):
        compare([])
    write_run(tmp_path / "sweep" / "0_rms")
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    monkeypatch.chdir(tmp_path)
    assert compare("sweep") == tmp_path / "sweep" / "report"  # a str: one path, not its letters


def test_report_md_counts_one_run_in_the_singular_and_quotes_any_dir_name_in_code(tmp_path):
    write_run(tmp_path / "runs" / "a`b|c")
    report = (compare([str(tmp_path / "runs")], out=tmp_path / "r") / "report.md").read_text()
    assert "1 run in 1 arm, read from " in report and "1 runs" not in report
    assert "- ``a`b|c``: " not in report  # a completed run is in the Runs table, not a list
    [row] = [line for line in report.splitlines() if line.startswith("| ``a`b\\\\|c``")]
    assert row.count(" | ") == 10  # its 11 cells: the backtick and the bar held inside the first


@pytest.mark.parametrize("cfg, given", [({"norm": {"name": "rms"}}, "a dict"), (None, "None")])
def test_train_run_takes_a_runconfig_and_names_it_for_anything_else(tmp_path, cfg, given):
    with pytest.raises(TypeError, match=rf"^cfg is {given}, not a RunConfig: .*RunConfig\.from_dict"):
        train_run(cfg, tmp_path / "run")
    with pytest.raises(TypeError, match=r"^run_dir is None, not a path"):
        train_run(tiny_config(), None)
    assert list(tmp_path.iterdir()) == []


def test_train_run_into_a_file_names_the_path_and_makes_nothing(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a dir")
    for run_dir in (taken, taken / "run"):
        with pytest.raises(ConfigError, match=f"^run_dir={re.escape(str(run_dir))}: {re.escape(str(taken))} is a file, "
                                              "not a directory: choose another run dir"):
            train_run(tiny_config(), run_dir)
    assert list(tmp_path.iterdir()) == [taken] and taken.read_text() == "not a dir"


def _sweep(root):
    write_run(root / "sweep" / "0_rms")
    (root / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    return root / "sweep"


@pytest.mark.parametrize("formats, says", [
    (("bmp",), "formats=('bmp',): 'bmp' is not a figure format"),
    (["png", "gif"], "formats=['png', 'gif']: 'gif' is not a figure format"),
    ("png,jpg", "formats='png,jpg': 'jpg' is not a figure format"),
    ((), "formats=(): no format is not a figure format"),
    (None, "formats=None: None is not a figure format"),
])
def test_compare_checks_the_formats_before_it_writes_anything(tmp_path, formats, says):
    sweep = _sweep(tmp_path)
    for out in (tmp_path / "report", None):
        with pytest.raises(CompareError, match=f"^{re.escape(says)}: choose from png, svg, pdf"):
            compare([sweep], out=out, formats=formats)
    assert not (tmp_path / "report").exists() and not (sweep / "report").exists()


def test_compare_takes_formats_as_a_tuple_or_as_the_command_lines_text(tmp_path):
    sweep = _sweep(tmp_path)
    out = compare(sweep, out=tmp_path / "one", formats="svg")
    assert sorted(p.name for p in out.glob("loss_val.*")) == ["loss_val.svg"]
    out = compare(sweep, out=tmp_path / "two", formats=" SVG,pdf")
    assert sorted(p.name for p in out.glob("loss_val.*")) == ["loss_val.pdf", "loss_val.svg"]


def test_load_runs_takes_paths_or_lists_of_them_as_compare_does(tmp_path):
    write_run(tmp_path / "a" / "0_rms")
    write_run(tmp_path / "b" / "0_rms")
    a, b = tmp_path / "a", tmp_path / "b"
    expected = [(a / "0_rms").resolve(), (b / "0_rms").resolve()]
    for given in ((a, b), ([a, b],), ([str(a)], (b,)), (iter([a, b]),)):
        assert [run.path for run in load_runs(*given)] == expected
    for bad in ((a, 3), ([a, None],)):
        with pytest.raises(TypeError, match=r"^(3|None) is not a path: give run dirs, sweep dirs or outputs/"):
            load_runs(*bad)
    with pytest.raises(TypeError, match=r"^3 is not a path"):
        compare([a, 3])
