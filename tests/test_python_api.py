"""The Python API (normlab.RunConfig, train_run, load_runs, compare) held to what the command line promises
(issue 37): a finished run dir is left as it was, a config is checked before anything is made, and a damaged
record is skipped with a note, not a traceback."""

import json

import pytest

from conftest import tiny_config
from normlab import RunConfig, compare, load_runs, train_run
from normlab.config import ConfigError
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
