"""One source for every default: `normlab train` composes RunConfig()'s values, and the YAML holds choices."""

import glob
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from normlab.cli import main
from normlab.config import DataConfig, NormConfig, OptimConfig, RunConfig, TokenizerConfig, flatten_config
from normlab.launch.prechecks import CONFIG_MODULE
from normlab.launch.resolvers import register_resolvers

CONF = Path(__file__).resolve().parent.parent / "conf"


def composed(*overrides: str) -> dict:
    """The config `normlab train OVERRIDES` composes, Hydra's node left out, as flat dotted keys."""
    register_resolvers()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    return flatten_config(raw)


def test_the_command_line_composes_runconfigs_defaults_key_for_key():
    # Before: lr 3e-3 vs 1e-3, max_steps 500 vs 600, eval_every 100 vs 200, model.vocab_size null vs 256,
    # and 23 keys (name, norm.momentum, data.files, ...) that only the schema had.
    cli, python = composed(), flatten_config(RunConfig())
    assert set(cli) == set(python), (set(cli) ^ set(python))
    assert {k: cli[k] for k in cli if cli[k] != python[k]} == {}
    assert RunConfig.from_dict(cli) == RunConfig()


@pytest.mark.parametrize("group, schema, chooser", [
    ("norm", NormConfig(), "name"), ("data", DataConfig(), "source"), ("tokenizer", TokenizerConfig(), "kind"),
    ("optim", OptimConfig(), None), ("model", RunConfig(), None),
])
def test_a_group_option_holds_its_choices_never_a_copy_of_a_default(group, schema, chooser):
    defaults = flatten_config(schema)
    for path in sorted(glob.glob(str(CONF / group / "*.yaml"))):
        held = flatten_config(yaml.safe_load(Path(path).read_text()) or {})
        copies = {k: v for k, v in held.items() if k != chooser and k in defaults and defaults[k] == v}
        assert copies == {}, f"{path} repeats the schema's defaults {copies}"


def test_name_is_a_key_that_names_the_run(tmp_path, monkeypatch, capsys):
    # Before: "name is not in the composed config; set it with +name=", and a set name changed nothing.
    assert composed("name=baseline")["name"] == "baseline"
    assert RunConfig(name="baseline").run_name == "baseline"
    assert RunConfig().run_name == "layer-pre-d4-lr3e-3-s0"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "name=baseline", "--cfg", "job"]) == 0
    assert "name: baseline" in capsys.readouterr().out
    assert main(["train", "name=a/b", "--cfg", "job"]) == 2
    assert "name='a/b': a run name has 1 to 100 characters, none of / \\" in capsys.readouterr().err
