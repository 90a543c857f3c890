"""train_run from Python says what the run did as `normlab train` does: its first and last lines, on the
terminal and in the run dir's normlab.log."""

import logging
import sys

from conftest import tiny_config

from normlab import train_run
from normlab.train.runlog import FORMAT


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "][normlab][INFO] - " in line]


def test_train_run_prints_the_first_and_last_line_and_writes_normlab_log(tmp_path, capsys, caplog, text_data):
    # Before: from Python nothing handled the logger's INFO lines: no line on the terminal, no normlab.log.
    logger = logging.getLogger("normlab")
    before = (logger.level, logger.propagate, list(logger.handlers))
    summary = train_run(tiny_config("rms", max_steps=2, data=text_data, sinks=["jsonl"]), tmp_path / "run")
    first = "rms-pre-d2-lr1e-3-s0: cpu, fp32, "
    last = f"rms-pre-d2-lr1e-3-s0 completed: final val loss {summary['final_val_loss']:.4f} ({summary['final_val_bpb']:.4f} bits/byte)"
    printed, logged = _lines(capsys.readouterr().out), _lines((tmp_path / "run" / "normlab.log").read_text())
    assert printed == logged and len(logged) == 2, logged
    assert first in logged[0] and f"parameters, run dir {(tmp_path / 'run').resolve()}" in logged[0] and last in logged[1]
    assert (logger.level, logger.propagate, list(logger.handlers)) == before  # the caller's logging as it was
    assert sum(r.name == "normlab" for r in caplog.records) >= 2  # the lines still reach the loggers above (caplog)


def test_echo_false_keeps_the_terminal_quiet_and_the_file_written(tmp_path, capsys, text_data):
    train_run(tiny_config("rms", max_steps=2, data=text_data, sinks=["jsonl"]), tmp_path / "run", echo=False)
    out = capsys.readouterr()
    assert _lines(out.out + out.err) == []
    assert len(_lines((tmp_path / "run" / "normlab.log").read_text())) == 2


def test_under_hydras_job_logging_each_line_is_written_once(tmp_path, text_data, capsys):
    # `normlab train`: Hydra's job logging holds the console and <run dir>/normlab.log on the root logger
    (tmp_path / "run").mkdir()
    root = logging.getLogger()
    handlers = [logging.FileHandler(tmp_path / "run" / "normlab.log"), logging.StreamHandler(sys.stdout)]
    level = root.level
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        train_run(tiny_config("rms", max_steps=2, data=text_data, sinks=["jsonl"]), tmp_path / "run")
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    assert len(_lines((tmp_path / "run" / "normlab.log").read_text())) == 2
    assert len(_lines(capsys.readouterr().out)) == 2
