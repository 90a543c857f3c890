"""The norm and placement registries: every row is complete, and the lists other code uses derive from them."""

import re
from importlib import resources
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import tiny_config
from normlab.telemetry import norms as probe
from normlab.config import (
    ALPHA_PARAMS,
    GAIN_PARAMS,
    NORM_TRAITS,
    NORMS,
    PLACEMENT_TRAITS,
    PLACEMENTS,
    SHIFT_PARAMS,
    ConfigError,
    NormConfig,
    NormTraits,
    RunConfig,
)
from normlab.launch.prechecks import check_jobs
from normlab.cli import main
from normlab.nn.model import GPT, block_slots
from normlab.nn.norms import NORM_CLASSES, Norm, build_norm, is_norm, needs_ddp_sync

NORMS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "norms.md"  # the norms table: "Adding a norm" names it


def _documented_norm_rows() -> set[str]:
    """The first cells (`name`) of the rows of docs/norms.md's norms table (the one headed `norm=`)."""
    lines = NORMS_PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `norm=` |"))
    names = set()
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            names.add(match.group(1))
    return names


def _norm_option(name: str) -> dict:
    return yaml.safe_load((resources.files("normlab.conf") / "norm" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", NORMS)
def test_every_registry_row_has_a_builder_a_yaml_file_and_a_docs_row(name):
    traits = NORM_TRAITS[name]
    assert all(cls in NORM_CLASSES for cls in traits.classes), f"norms.py has no class for {traits.classes}"
    module = build_norm(NormConfig(name=name), 8, positions=4)
    assert type(module).__name__ == traits.classes[0] if traits.classes else isinstance(module, nn.Identity)
    assert _norm_option(name)["name"] == name
    assert name in _documented_norm_rows()


def test_every_norm_option_sets_only_knobs_its_norm_reads():
    for path in (resources.files("normlab.conf") / "norm").iterdir():
        option = yaml.safe_load(path.read_text())
        assert set(option) - {"name"} <= set(NORM_TRAITS[option["name"]].knobs), path.name


@pytest.mark.parametrize("name", NORMS)
def test_a_norms_parameters_are_the_gains_and_alphas_its_row_names(name):
    module = build_norm(NormConfig(name=name), 8, positions=4)
    params = {n for n, _ in module.named_parameters()}
    traits = NORM_TRAITS[name]
    named = set(traits.gains) | set(traits.alphas) | set(traits.shifts)
    assert named <= params
    assert not params & (set(GAIN_PARAMS) | set(ALPHA_PARAMS) | set(SHIFT_PARAMS)) - named


def test_the_derived_lists():
    assert NORMS == ("none", "layer", "rms", "batch", "dyt", "derf", "scale", "l2")
    assert PLACEMENTS == ("pre", "post", "sandwich", "deepnorm", "mix", "reordered", "lns")
    assert GAIN_PARAMS == ("weight", "g") and probe.GAIN_PARAMS is GAIN_PARAMS
    assert probe.ALPHA_PARAM == "alpha" and probe.SHIFT_PARAM == "shift" and SHIFT_PARAMS == ("shift",)
    assert [n for n in NORMS if not NORM_TRAITS[n].per_token] == ["batch"]
    bn, causal = (build_norm(NormConfig(name="batch", causal=c), 8, positions=4) for c in (False, True))
    ln = build_norm(NormConfig(name="layer"), 8)
    assert needs_ddp_sync(bn) and needs_ddp_sync(causal) and not needs_ddp_sync(ln)


def test_every_placement_row_fills_known_slots():
    for name, traits in PLACEMENT_TRAITS.items():
        assert set(traits.slots) <= {"pre", "branch", "post"} and traits.slots, name
        assert traits.leading is None or traits.leading in PLACEMENT_TRAITS
    slots = [block_slots("mix", i, 8, 0.25) for i in range(8)]
    assert [s.post for s in slots] == [True, True] + [False] * 6
    assert block_slots("deepnorm", 0, 8).alpha == pytest.approx(16**0.25)


class PeakNorm(Norm):
    """A stand-in new norm for the tests: y = w ⊙ x / max|x|."""

    def __init__(self, dim: int, eps: float = 1e-5, weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        y = x / x.abs().amax(-1, keepdim=True).clamp(min=self.eps)
        return y if self.weight is None else y * self.weight


@pytest.fixture
def peak(monkeypatch):
    """A registry row for PeakNorm: what a maintainer adds for a new norm, besides its class."""
    traits = NormTraits("PeakNorm", knobs=("eps", "weight"), classes=("PeakNorm",), gains=("weight",))
    monkeypatch.setitem(NORM_TRAITS, "peak", traits)
    return traits


def test_a_new_registry_row_is_a_norm_everywhere(peak, monkeypatch):
    cfg = tiny_config("peak", "sandwich", qk_norm=True)  # validates: a per-token norm with a gain
    assert cfg.norm.label == "peak" and NormConfig(name="peak", weight=False).label == "peak_noweight"
    model = GPT(cfg)
    norms = [m for m in model.modules() if is_norm(m)]
    assert norms and all(isinstance(m, PeakNorm) for m in norms)
    assert isinstance(model.blocks[0].attn.q_norm, PeakNorm) and not needs_ddp_sync(norms[0])
    assert model(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, 256)  # model.vocab_size=null: the byte tokenizer's

    monkeypatch.setitem(NORM_TRAITS, "peak", NormTraits("PeakNorm", ("eps",), ("PeakNorm",), batch_statistics=True))
    with pytest.raises(ConfigError, match="qk_norm=true with norm=peak: PeakNorm is not a per-token norm"):
        tiny_config("peak", qk_norm=True)
    assert needs_ddp_sync(norms[0])


# ---------------------------------------------------------------- knobs a norm does not read


def test_a_knob_the_norm_does_not_read_is_refused_unless_at_its_default():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"norm": {"name": "scale", "weight": False}})
    assert str(err.value) == ("norm.weight=false: norm=scale has no knob 'weight'; its knobs are eps "
                              "(norm=layer, norm=rms, norm=batch, norm=dyt, norm=derf read it)")
    with pytest.raises(ConfigError, match="norm.momentum=0.3: norm=layer has no knob 'momentum'; its knobs are eps, weight, bias"):
        RunConfig.from_dict({"norm": {"name": "layer", "momentum": 0.3}})
    # At its default a knob changes nothing: a saved run's config lists every knob, and loads.
    assert RunConfig.from_dict({"norm": {**NormConfig(name="scale").__dict__}}).norm.name == "scale"
    assert RunConfig.from_dict({"norm": {"name": "dyt", "alpha_attn": 0.9, "weight": False}}).norm.label == "dyt_noweight"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["norm=scale", "norm.weight=false"], "norm.weight=false: norm=scale has no knob 'weight'; its knobs are eps"),
        # every knob is in the composed config (the schema's), so + is refused before the knob is
        (["norm=scale", "+norm.weight=true"], "norm.weight is already in the config: write norm.weight=true (without +)"),
        (["norm=layer", "norm.causal=true"], "norm.causal=true: norm=layer has no knob 'causal'; its knobs are eps, weight, bias"),
        (["-m", "norm=layer,dyt", "norm.alpha_attn=1.0"], "norm.alpha_attn=1.0: norm=layer has no knob 'alpha_attn'"),
    ],
)
def test_the_cli_refuses_a_knob_the_norm_does_not_read_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv, "model=tiny", "max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("normlab: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "outputs").exists()


def test_the_cli_check_passes_knobs_the_norm_reads():
    check_jobs(["norm.name=rms", "norm.weight=false"], [], multirun=False)
    check_jobs(["norm=layer,rms,dyt", "norm.weight=false,true"], [], multirun=True)
    with pytest.raises(ConfigError, match="norm=dyt has no knob .eps.; its knobs are alpha_attn, alpha_mlp, alpha_final, weight, bias"):
        check_jobs(["norm=layer,rms,dyt", "norm.eps=1e-6"], [], multirun=True)


def test_a_preset_may_not_set_a_knob_off_its_default_for_a_norm_that_does_not_read_it(tmp_path, monkeypatch, capsys):
    """The preset's DyT α would be silently ignored by its LayerNorm arms: a norm option file is the way."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "alpha.yaml").write_text(
        "# @package _global_\nnorm:\n  alpha_attn: 1.0\nhydra:\n  sweeper:\n    params:\n      norm: layer,dyt\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", "--config-dir", "conf", "+experiment=alpha", "model=tiny", "max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "norm.alpha_attn=1.0: norm=layer has no knob 'alpha_attn'" in err and "norm=layer" in err.split("(in")[1]
    assert not (tmp_path / "outputs").exists()
