"""Validation of norm × placement × QK-norm combinations, run names, and the norm group options."""

from importlib import resources

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from conftest import tiny_config
from normlab.launch.prechecks import sweep_jobs
from normlab.launch.resolvers import register_resolvers
from normlab.cli import main
from normlab.config import ConfigError, NormConfig, RunConfig


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(norm="none", placement="deepnorm"), "placement=deepnorm with norm=none"),
        (dict(norm="batch", qk_norm=True), "qk_norm=true with norm=batch"),
        (dict(norm="l2", qk_norm=True), "qk_norm=true with norm=l2"),
        (dict(norm="batch", causal=True, batch_size=2, grad_accum=2), "norm=batch_causal takes its statistics per position"),
        (dict(norm="batch", batch_size=1, seq_len=1), "norm=batch takes its statistics over micro-batch × time"),
        (dict(norm="layer", placement="mix", mix_p=1.5), "mix_p=1.5: must be between 0 and 1"),
        (dict(norm="layer", placement="mix", mix_p=-0.1), "mix_p=-0.1: must be between 0 and 1"),
        (dict(norm="dyt", alpha_mlp=0.0), "norm.alpha_mlp=0.0: must be a positive number"),
        # validate() checks types as from_dict does first: a NaN is refused as from_dict refuses it
        (dict(norm="dyt", alpha_final=float("nan")), "norm.alpha_final=nan: must be a finite number (not nan or inf)"),
    ],
)
def test_combinations_that_make_no_sense_are_rejected_with_the_reason(overrides, message):
    cfg = tiny_config("layer")  # valid; then made invalid one key at a time
    cfg.norm.name = overrides.pop("norm")
    for key, value in overrides.items():
        setattr(cfg.norm if key in ("causal", "alpha_mlp", "alpha_final") else cfg, key, value)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "norm,placement,qk_norm",
    [
        ("layer", "deepnorm", True),
        ("dyt", "sandwich", True),
        ("scale", "mix", True),
        ("none", "pre", True),  # QK-norm is RMSNorm here
        ("none", "sandwich", False),
        ("l2", "deepnorm", False),
        ("batch", "mix", False),
    ],
)
def test_sensible_combinations_pass(norm, placement, qk_norm):
    tiny_config(norm, placement, qk_norm=qk_norm).validate()


def test_causal_batch_norm_needs_two_sequences_per_micro_batch_only():
    cfg = tiny_config("batch", batch_size=2, grad_accum=1)
    cfg.norm.causal = True
    cfg.validate()  # two sequences per position: enough
    cfg.grad_accum = 2
    with pytest.raises(ConfigError, match="holds 1 value"):
        cfg.validate()
    cfg.norm.causal = False
    cfg.validate()  # one sequence of 16 positions: batch × time statistics have 16 values


def test_qk_norm_config_is_the_norm_type_or_rms_under_none():
    assert tiny_config("layer").qk_norm_config() is None
    assert tiny_config("dyt", qk_norm=True).qk_norm_config().name == "dyt"
    cfg = tiny_config("none", qk_norm=True)
    cfg.norm.eps = 1e-6
    assert cfg.qk_norm_config() == NormConfig(name="rms", eps=1e-6, weight=True)


@pytest.mark.parametrize(
    "norm,label",
    [
        (NormConfig(name="rms", weight=False), "rms_noweight"),
        (NormConfig(name="layer", bias=False), "layer_nobias"),
        (NormConfig(name="layer", weight=False, bias=False), "layer_noweight_nobias"),
        (NormConfig(name="batch", causal=True), "batch_causal"),
        (NormConfig(name="rms", bias=False, causal=True), "rms"),  # knobs RMSNorm does not have
        (NormConfig(name="scale", weight=False), "scale"),
        (NormConfig(name="dyt", alpha_attn=0.9), "dyt"),
    ],
)
def test_norm_labels_name_the_switched_off_parts(norm, label):
    assert norm.label == label


def test_run_names_tell_arms_apart():
    assert tiny_config("layer").run_name == "layer-pre-d2-lr1e-3-s0"
    cfg = tiny_config("rms", "mix", qk_norm=True, mix_p=0.5, lr=3e-3)
    cfg.norm.weight = False
    assert cfg.run_name == "rms_noweight-mix0.5-qk-d2-lr3e-3-s0"


def _norm_options() -> list[str]:
    return sorted(p.name[:-5] for p in (resources.files("normlab.conf") / "norm").iterdir() if p.name.endswith(".yaml"))


def test_every_norm_option_is_named_by_its_label():
    """`norm=rms_noweight` composes to RMSNorm without a weight, and runs named `rms_noweight-...`."""
    options = _norm_options()
    assert {"dyt", "scale", "l2", "rms_noweight", "layer_noweight", "layer_nobias", "batch_causal"} <= set(options)
    register_resolvers()
    with initialize_config_module("normlab.conf", version_base="1.3"):
        for option in options:
            raw = OmegaConf.to_container(compose("config", [f"norm={option}", "model=tiny", "seq_len=64"]), resolve=True)
            assert RunConfig.from_dict(raw).norm.label == option


def test_sweep_jobs_is_the_cartesian_product():
    jobs = sweep_jobs(["norm=none,layer", "placement=pre,deepnorm", "seed=3", "seed=3"])
    assert jobs == [
        ["norm=none", "placement=pre", "seed=3"],
        ["norm=none", "placement=deepnorm", "seed=3"],
        ["norm=layer", "placement=pre", "seed=3"],
        ["norm=layer", "placement=deepnorm", "seed=3"],
    ]
    # a later value of a key replaces an earlier one (a preset's sweep, then the command line)
    assert sweep_jobs(["norm=none,layer", "placement=pre", "norm=rms"]) == [["norm=rms", "placement=pre"]]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["-m", "norm=layer,none", "placement=pre,deepnorm"],
            "placement=deepnorm with norm=none: DeepNorm up-weights the residual",
        ),
        (["norm=batch", "qk_norm=true"], "qk_norm=true with norm=batch"),
        (["-m", "placement=pre,mix", "mix_p=0.5,2"], "mix_p=2.0: must be between 0 and 1"),
        (["placement=sandwitch"], "placement='sandwitch' is not allowed"),
    ],
)
def test_cli_rejects_a_bad_combination_before_any_job_runs(argv, message, tmp_path, monkeypatch, capsys):
    """A sweep with one senseless job stops before the first job, so no half-finished sweep is left."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("normlab: error: ") and message in err and err.count("\n") == 1
    if "-m" in argv:
        assert "(in the sweep's job " in err
    assert not (tmp_path / "outputs").exists()


def test_cli_checks_the_sweeps_a_preset_defines(tmp_path, monkeypatch, capsys):
    """Sweeps in hydra.sweeper.params (experiment presets) are checked like command-line ones."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "grid.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      norm: none,layer\n      placement: pre,deepnorm\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", "--config-dir", "conf", "+experiment=grid", "model=tiny", "seq_len=32"]) == 2
    err = capsys.readouterr().err
    assert "placement=deepnorm with norm=none" in err and "norm=none placement=deepnorm" in err
    assert not (tmp_path / "outputs").exists()
