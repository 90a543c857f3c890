# FROZEN REFERENCE: a verbatim copy of normlab/train/probe_norms.py at commit 9034483a19e1d273422b5896e68008abef312981,
# its imports of the other probe modules pointed at this package. tests/test_telemetry_golden.py compares
# the live Probe's statistics against it. Do not edit it (not even to follow a rename or a fix): it is what
# the statistics meant before issue 36 changed the Probe. A key whose definition changes on purpose keeps
# its old definition here; the golden test compares the live key against the new one, computed in the test.
"""The norms the telemetry Probe watches: where they sit in the model, and the statistics of their parameters.

A norm slot is named by its location: 'L03/norm1', 'L03/norm1_out', 'L03/q_norm' (QK-norm, one module
shared by the heads), 'norm_f' (before the head), 'norm_embed' (embed_norm=true's, on token + position
embedding). Its parameter statistics are taken on tensors stacked along a leading
member dimension, (M, *shape), so that an unpacked model (M = 1) and a packed one (normlab.train.pack)
share one computation.
"""

from __future__ import annotations

from typing import Iterable, Mapping

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


@torch.no_grad()
def norm_parameter_stats(loc: str, params: Iterable[tuple[str, torch.Tensor]],
                         running_var: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The statistics of the norm at `loc`: from its parameters `params` ((name, tensor (M, *shape))), the
    gain's mean and population std, α and the shift s; from its `running_var` (M, *shape) the mean. Each value has shape (M,)."""
    stats = {}
    for name, stacked in params:
        values = stacked.detach().float().reshape(stacked.shape[0], -1)  # not flatten(1): a scalar stacks to (M,)
        if name in GAIN_PARAMS:
            stats[f"norm/gain_mean/{loc}"] = values.mean(1)
            stats[f"norm/gain_std/{loc}"] = values.std(1, correction=0)
        elif name == ALPHA_PARAM:
            stats[f"norm/alpha/{loc}"] = values.mean(1)
        elif name == SHIFT_PARAM:
            stats[f"norm/shift/{loc}"] = values.mean(1)
    if running_var is not None:
        stats[f"norm/running_var/{loc}"] = running_var.float().flatten(1).mean(1)
    return stats


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
    Below 1 the norm is eps-dominated: ε exceeds its input's mean square."""
    return {f"{EPS_RATIO}/{loc}": stats[f"act/norm_in_rms/{loc}"] / floor
            for loc, floor in floors.items() if f"act/norm_in_rms/{loc}" in stats}


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
        return (f"eps-dominated norms at step {step}, input RMS / sqrt(eps) below 1 ({EPS_RATIO}): {slots}; "
                f"such a norm scales its input by about 1/sqrt(eps) instead of normalizing it")
