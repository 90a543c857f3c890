"""The registries: one row per norm (`norm.name`), one per placement, and the sinks' names.

Every other list of norms or placements (NORMS, GAIN_PARAMS, PLACEMENTS, ...) derives from these rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from normlab.config.errors import ConfigError

SINK_NAMES = ("jsonl", "csv", "wandb")  # the sinks normlab.train.sinks builds by name (its SINKS)


@dataclass(frozen=True)
class NormTraits:
    """One norm's row in the registry: what every layer outside its module needs to know about it.

    The module itself is `normlab.nn.norms.<classes[0]>`; it is named here, not imported, so the
    registry (and config validation) needs no torch.
    """

    title: str  # the norm's usual name in prose: 'LayerNorm'
    knobs: tuple[str, ...] = ()  # the NormConfig fields it reads; any other knob is an error
    classes: tuple[str, ...] = ()  # its module classes in normlab.nn.norms, the first builds it; none: nn.Identity
    batch_statistics: bool = False  # statistics across the batch, not per token: not causal in training
    gains: tuple[str, ...] = ()  # parameters that scale its output (telemetry: norm/gain_mean, norm/gain_std)
    alphas: tuple[str, ...] = ()  # learnable input scales (telemetry: norm/alpha)
    shifts: tuple[str, ...] = ()  # learnable input shifts (telemetry: norm/shift)

    @property
    def per_token(self) -> bool:
        """Each token is normalized on its own, so it is causal in training and has a per-head form (QK-norm)."""
        return not self.batch_statistics

    @property
    def ddp_sync(self) -> bool:
        """Under DDP its statistics must span every process's rows (unless norm.sync=false)."""
        return self.batch_statistics


# The norm registry: one row per `norm.name`. Adding a norm: its class in normlab/nn/norms.py, a row
# here (normlab/config/registry.py), conf/norm/<name>.yaml and its row in the norms table of
# docs/norms.md (tests/test_registry.py checks all four).
NORM_TRAITS: dict[str, NormTraits] = {
    "none": NormTraits("no norm", knobs=("eps",)),  # eps: QK-norm's RMSNorm under norm=none
    "layer": NormTraits("LayerNorm", ("eps", "weight", "bias"), ("LayerNorm",), gains=("weight",)),
    "rms": NormTraits("RMSNorm", ("eps", "weight"), ("RMSNorm",), gains=("weight",)),
    "batch": NormTraits(
        "BatchNorm",
        ("eps", "momentum", "weight", "bias", "sync", "causal", "stat_rows"),
        ("BatchNorm", "CausalBatchNorm"),
        batch_statistics=True,
        gains=("weight",),
    ),
    "dyt": NormTraits(
        "DyT", ("alpha_attn", "alpha_mlp", "alpha_final", "weight", "bias"), ("DyT",), gains=("weight",), alphas=("alpha",)
    ),
    "derf": NormTraits(
        "Derf",
        ("alpha_attn", "alpha_mlp", "alpha_final", "shift", "weight", "bias"),
        ("Derf",),
        gains=("weight",),
        alphas=("alpha",),
        shifts=("shift",),
    ),
    "scale": NormTraits("ScaleNorm", ("eps",), ("ScaleNorm",), gains=("g",)),
    "l2": NormTraits("L2 norm", ("eps",), ("L2Norm",)),
}
NORMS = tuple(NORM_TRAITS)
GAIN_PARAMS = tuple(dict.fromkeys(p for t in NORM_TRAITS.values() for p in t.gains))
ALPHA_PARAMS = tuple(dict.fromkeys(p for t in NORM_TRAITS.values() for p in t.alphas))
SHIFT_PARAMS = tuple(dict.fromkeys(p for t in NORM_TRAITS.values() for p in t.shifts))
# Structural knobs the label names when they differ from the default (only for norms that read them).
LABEL_SUFFIXES = (("weight", False, "_noweight"), ("bias", False, "_nobias"), ("causal", True, "_causal"))


def norm_traits(name: str) -> NormTraits:
    """The registry row of norm `name`; ValueError naming the known norms otherwise."""
    if name not in NORM_TRAITS:
        raise ValueError(f"unknown norm {name!r}: choose one of {', '.join(NORMS)}")
    return NORM_TRAITS[name]


def check_norm_knob(norm: str, knob: str, value: Any) -> None:
    """ConfigError naming the knob, the norm and its knobs, unless norm `norm` reads `knob`."""
    knobs = norm_traits(norm).knobs
    if knob not in knobs:
        shown = str(value).lower() if isinstance(value, bool) else value
        readers = [f"norm={name}" for name, traits in NORM_TRAITS.items() if knob in traits.knobs]
        raise ConfigError(
            f"norm.{knob}={shown}: norm={norm} has no knob {knob!r}; its knobs are {', '.join(knobs) or 'none'}"
            + (f" ({', '.join(readers)} read it)" if readers else "")
        )


@dataclass(frozen=True)
class PlacementTraits:
    """Which norm slots around each sublayer f a placement fills, and how it scales the residual."""

    slots: tuple[str, ...]  # of 'pre' (before f), 'branch' (after f, before the add), 'post' (after the add)
    deepnorm: bool = False  # residual × α = (2N)^(1/4), and β = (8N)^(-1/4) on the init (Wang et al. 2022)
    leading: str | None = None  # mix: the first ⌊mix_p·depth⌋ blocks take this placement instead
    depth_scale: bool = False  # LayerNorm Scaling: the pre slot's norm output × 1/sqrt(ℓ), ℓ the 1-based block (Sun et al. 2025)


PLACEMENT_TRAITS: dict[str, PlacementTraits] = {
    "pre": PlacementTraits(("pre",)),
    "post": PlacementTraits(("post",)),
    "sandwich": PlacementTraits(("pre", "branch")),
    "deepnorm": PlacementTraits(("post",), deepnorm=True),
    "mix": PlacementTraits(("pre",), leading="post"),
    "reordered": PlacementTraits(("branch",)),  # OLMo 2: x + Norm(f(x))
    "lns": PlacementTraits(("pre",), depth_scale=True),
}
PLACEMENTS = tuple(PLACEMENT_TRAITS)
