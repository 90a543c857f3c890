"""The norms the telemetry Probe watches: where they sit in the model, and the statistics of their parameters.

A norm slot is named by its location: 'L03/norm1', 'L03/norm1_out', 'L03/q_norm' (QK-norm, one module
shared by the heads), 'norm_f' (before the head), 'norm_embed' (embed_norm=true's, on token + position
embedding). Its parameter statistics are taken on the norms' tensors of one kind and shape stacked, with a
member dimension, (norms, M, *shape), so that an unpacked model (M = 1) and a packed one (normlab.train.pack)
share one computation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from normlab.config import ALPHA_PARAMS, GAIN_PARAMS, SHIFT_PARAMS

# The norm registry names the parameters whose mean and std are a norm's gain (GAIN_PARAMS), DyT's and
# Derf's scalar α, reported as norm/alpha, and Derf's scalar shift s, reported as norm/shift: one name for
# every norm that has one.
(ALPHA_PARAM,) = ALPHA_PARAMS
(SHIFT_PARAM,) = SHIFT_PARAMS


def _is_norm_slot(name: str, module: nn.Module) -> bool:
    # Slots are named norm1, norm2, norm1_out, ... in every arm; an unused slot is an nn.Identity.
    return name.startswith("norm") and not isinstance(module, nn.Identity)


def norm_modules(model: nn.Module, labels: list[str]) -> dict[str, nn.Module]:
    """Every norm of `model` that is not an identity, by location: 'norm_embed', 'L03/norm1', ...,
    'L03/q_norm', 'L03/k_norm', 'norm_f' (`labels`: the blocks' layer labels)."""
    norms = {}
    if _is_norm_slot("norm_embed", getattr(model, "norm_embed", nn.Identity())):
        norms["norm_embed"] = model.norm_embed
    for label, block in zip(labels, model.blocks):
        for name, child in block.named_children():
            if _is_norm_slot(name, child):
                norms[f"{label}/{name}"] = child
        for name in ("q_norm", "k_norm"):  # QK-norm, one module shared by the heads
            if not isinstance(getattr(block.attn, name), nn.Identity):
                norms[f"{label}/{name}"] = getattr(block.attn, name)
    if _is_norm_slot("norm_f", model.norm_f):
        norms["norm_f"] = model.norm_f
    return norms


@dataclass(frozen=True)
class NormParams:
    """Norm tensors whose statistics are logged, of one kind and one shape, so that they stack: `kind` is gain
    (a GAIN_PARAMS parameter: mean and population std), alpha (DyT's and Derf's α), shift (Derf's s) or
    running_var (BatchNorm's buffer: its mean); `names` are the tensors' names in the model, `locs` their norms'."""

    kind: str
    locs: tuple[str, ...]
    names: tuple[str, ...]


def norm_parameter_groups(model: nn.Module, norms: Mapping[str, nn.Module]) -> list[NormParams]:
    """The logged tensors of the norms `norms` (by location) of `model`, grouped by kind and shape."""
    owner = {id(m): name for name, m in model.named_modules()}
    groups: dict[tuple, tuple[list[str], list[str]]] = {}

    def add(kind: str, loc: str, name: str, tensor: torch.Tensor) -> None:
        locs, names = groups.setdefault((kind, tuple(tensor.shape)), ([], []))
        locs.append(loc)
        names.append(f"{owner[id(norms[loc])]}.{name}")

    for loc, norm in norms.items():
        for name, param in norm.named_parameters(recurse=False):
            kind = "gain" if name in GAIN_PARAMS else "alpha" if name == ALPHA_PARAM else "shift" if name == SHIFT_PARAM else None
            if kind is not None:
                add(kind, loc, name, param)
        if isinstance(getattr(norm, "running_var", None), torch.Tensor):
            add("running_var", loc, "running_var", norm.running_var)
    return [NormParams(kind, tuple(locs), tuple(names)) for (kind, _), (locs, names) in groups.items()]


@torch.no_grad()
def norm_parameter_stats(group: NormParams, stacked: torch.Tensor) -> tuple[tuple[str, ...], torch.Tensor]:
    """The keys of `group`'s statistics and their values, (len(keys), M), from its tensors stacked as
    (len(group.locs), M, *shape) (M: the members of a pack, 1 for one model): a gain's mean and population
    std, α's and s's value (their mean), the running variance's mean over features."""
    values = stacked.float().reshape(*stacked.shape[:2], -1)
    if group.kind == "gain":
        keys = (*(f"norm/gain_mean/{loc}" for loc in group.locs), *(f"norm/gain_std/{loc}" for loc in group.locs))
        return keys, torch.cat([values.mean(-1), values.std(-1, correction=0)])
    return tuple(f"norm/{group.kind}/{loc}" for loc in group.locs), values.mean(-1)


# norm/eps_ratio/<loc>: the norm's input RMS over the RMS below which its ε dominates (Norm.eps_rms).
EPS_RATIO = "norm/eps_ratio"


def eps_floors(norms: Mapping[str, nn.Module]) -> dict[str, float]:
    """Each norm's `eps_rms()` by location, for the norms that have an ε (DyT and Derf have none)."""
    floors = {}
    for loc, norm in norms.items():
        floor = norm.eps_rms() if callable(getattr(norm, "eps_rms", None)) else None
        if floor is not None:
            floors[loc] = floor
    return floors


def eps_ratios(stats: Mapping[str, float], floors: Mapping[str, float]) -> dict[str, float]:
    """norm/eps_ratio/<loc> = act/norm_in_rms/<loc> / the norm's eps_rms, for the norms measured in `stats`.
    Below 1 the norm is eps-dominated: its ε, not its input, sets its scale (ε exceeds the input's mean square,
    or for ScaleNorm and L2 its norm ‖x‖)."""
    ratios = {}
    for loc, floor in floors.items():
        rms_key, ratio_key = _eps_keys(loc)
        if rms_key in stats:
            ratios[ratio_key] = stats[rms_key] / floor
    return ratios


@functools.lru_cache(maxsize=None)  # the host names a run's keys once, not at every telemetry step
def _eps_keys(loc: str) -> tuple[str, str]:
    """The keys of a norm's input RMS and of its eps ratio."""
    return f"act/norm_in_rms/{loc}", f"{EPS_RATIO}/{loc}"


class EpsWarnings:
    """The run's warning about eps-dominated norms: one line naming the slots whose input RMS fell below
    their ε's (norm/eps_ratio < 1), each slot named once per run."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def line(self, stats: Mapping[str, float], step: int) -> str | None:
        """The warning for the slots of `stats` newly eps-dominated at `step`, or None."""
        prefix = f"{EPS_RATIO}/"
        new = {key[len(prefix):]: v for key, v in stats.items()
               if key.startswith(prefix) and v < 1 and key[len(prefix):] not in self.warned}
        if not new:
            return None
        self.warned |= new.keys()
        slots = ", ".join(f"{loc} ({ratio:.2g})" for loc, ratio in new.items())
        return (f"eps-dominated norms at step {step}, input RMS below where eps takes over ({EPS_RATIO} < 1): "
                f"{slots}; such a norm scales its input by a gain eps sets (about 1/sqrt(eps) for LayerNorm, RMSNorm "
                f"and BatchNorm, g/eps for ScaleNorm, 1/eps for L2) instead of normalizing it")
