"""The parameter groups of the telemetry Probe's gradient norms and update ratios, and their host-side arithmetic.

A group is a location's parameters: 'L03' (the whole block), 'L03/attn', 'L03/mlp', 'L03/norms', 'L03/gate1',
'embed', 'norm_embed', 'norm_f'. The Probe measures one L2 norm per parameter (of its gradient, its weight and
its update) on the device; a group's norm is combined from its members' on the host.
"""

from __future__ import annotations

import math

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


def group_stats(groups: dict[str, list[int]], labels: tuple[str, ...], grad: list[float], weight: list[float],
                delta: list[float]) -> dict[str, float]:
    """grad/norm/<loc> (and GROUP_GRAD_KEYS) and update_ratio/<loc> from each parameter's gradient, weight and
    update norms (empty lists: not measured)."""
    stats = {}
    for loc in groups:
        members = figure_members(groups, loc, labels)
        if grad:
            stats[GROUP_GRAD_KEYS.get(loc, f"grad/norm/{loc}")] = _group_norm(grad, members)
        if delta:
            norm = _group_norm(weight, members)
            stats[f"update_ratio/{loc}"] = _group_norm(delta, members) / norm if norm > 0 else math.nan
    return stats


def _group_norm(norms: list[float], members: list[int]) -> float:
    """The L2 norm of a group of tensors, from each member's L2 norm."""
    return math.sqrt(sum(norms[i] ** 2 for i in members))
