"""The parameter groups of the telemetry Probe's gradient norms and update ratios, and their host-side arithmetic.

A group is a location's parameters: 'L03' (the whole block), 'L03/attn', 'L03/mlp', 'L03/norms', 'L03/gate1',
'embed', 'norm_embed', 'norm_f'. The Probe measures one L2 norm per parameter (of its gradient, its weight and
its update) on the device; a group's norm is combined from its members' on the host.
"""

from __future__ import annotations

import math
import operator

from torch import nn

# The gradient-norm keys of the parameter groups outside the blocks (a block's group 'L03/attn' is grad/norm/L03/attn).
GROUP_GRAD_KEYS = {"embed": "grad/embed_norm", "norm_embed": "grad/norm_embed_norm", "norm_f": "grad/norm_f_norm"}


def param_groups(model: nn.Module, labels: tuple[str, ...]) -> tuple[list[nn.Parameter], dict[str, list[int]]]:
    """The model's parameters (each once) and groups of their indices by location: 'L03' (the whole block),
    'L03/attn', 'L03/mlp', 'L03/norms', 'L03/gate1', 'L03/gate2' (residual gates), 'embed', 'norm_embed', 'norm_f'.

    'L03/norms' holds every norm parameter of the block, QK-norm's gains included; 'L03/attn' holds the
    attention's projections only. The keys of 'L03' are over a part of it (`figure_members`)."""
    params: list[nn.Parameter] = []
    index: dict[int, int] = {}

    def ids(modules_params) -> list[int]:
        out = []
        for p in modules_params:
            if id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
            out.append(index[id(p)])
        return out

    groups = {
        "embed": ids([model.tok_emb.weight, model.pos_emb.weight]),  # tok_emb is also the tied head
        "norm_embed": ids(getattr(model, "norm_embed", nn.Identity()).parameters()),
        "norm_f": ids(model.norm_f.parameters()),
    }
    for label, block in zip(labels, model.blocks):
        groups[label] = ids(block.parameters())
        for name, child in block.named_children():
            part = "norms" if name.startswith("norm") else name
            qk_norms = [child.q_norm, child.k_norm] if name == "attn" else []
            qk = {id(p) for norm in qk_norms for p in norm.parameters()}
            groups.setdefault(f"{label}/{part}", []).extend(ids(p for p in child.parameters() if id(p) not in qk))
            groups.setdefault(f"{label}/norms", []).extend(ids(p for norm in qk_norms for p in norm.parameters()))
    return params, {loc: members for loc, members in groups.items() if members}


def figure_members(groups: dict[str, list[int]], loc: str, labels: tuple[str, ...]) -> list[int]:
    """The parameters of grad/norm/<loc> and update_ratio/<loc>: a whole block's figures ('L03') are over its
    sublayers' weights (attn and mlp) alone, its norms' and residual gates' parameters left out, so that they
    compare across arms that differ in norms and gates: a norm or gate adds to the figures of the arms that have
    one, and norm gains, near 1, would set an update ratio's denominator. Those parameters have their own keys
    (L03/norms, L03/gate1, L03/gate2)."""
    if loc not in labels:
        return groups[loc]
    return groups.get(f"{loc}/attn", []) + groups.get(f"{loc}/mlp", [])


def group_figures(groups: dict[str, list[int]], labels: tuple[str, ...]) -> list[tuple[str, str, list[int]]]:
    """(gradient-norm key, update-ratio key, members) of each group: what `group_stats` computes, made once."""
    return [(GROUP_GRAD_KEYS.get(loc, f"grad/norm/{loc}"), f"update_ratio/{loc}", figure_members(groups, loc, labels))
            for loc in groups]


def group_stats(figures: list[tuple[str, str, list[int]]], grad: list[float], weight: list[float],
                delta: list[float]) -> dict[str, float]:
    """grad/norm/<loc> (and GROUP_GRAD_KEYS) and update_ratio/<loc> from each parameter's gradient, weight and
    update norms (empty lists: not measured); `figures`: group_figures. A group's norm is the root of the sum of
    its members' squared norms."""
    grad2, weight2, delta2 = (list(map(operator.mul, norms, norms)) for norms in (grad, weight, delta))
    stats = {}
    for grad_key, ratio_key, members in figures:
        if grad:
            stats[grad_key] = math.sqrt(sum(grad2[i] for i in members))
        if delta:
            norm = math.sqrt(sum(weight2[i] for i in members))
            stats[ratio_key] = math.sqrt(sum(delta2[i] for i in members)) / norm if norm > 0 else math.nan
    return stats
