"""Telemetry of the norms themselves: the embedding norm observed like every other norm (its input, its
parameters, Derf's shift)."""

import math

import pytest
import torch

from conftest import tiny_config
from normlab.nn.model import GPT
from normlab.train.probe import Probe


def rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def l2(tensors) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in tensors))


def probe_one_step(model: GPT, idx: torch.Tensor, lr: float = 1e-2) -> dict[str, float]:
    """One watched forward, backward (loss: the mean logit) and AdamW step of `model`; its statistics."""
    probe = Probe(model, every=1, max_steps=1)
    with probe.watch():
        model(idx).mean().backward()
    probe.measure_gradients(torch.amp.GradScaler("cpu", enabled=False))
    probe.before_update()
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    return probe.collect()


def test_the_embedding_norm_is_observed_like_every_norm():
    """With embed_norm=true, act/embed_* and grad/embed_rms are the token + position embedding's (the norm's
    input, as documented), the norm's output is act/norm_out_rms/norm_embed, and its parameters have their
    gradient norm, update ratio, gains, α and Derf's shift."""
    torch.manual_seed(0)
    model = GPT(tiny_config("derf", "pre", embed_norm=True))
    norm = model.norm_embed
    with torch.no_grad():
        norm.alpha.fill_(0.7)
        norm.shift.fill_(0.3)
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    # The same forward and backward by hand, on a copy, with the embedding's gradient kept.
    copy = GPT(tiny_config("derf", "pre", embed_norm=True))
    copy.load_state_dict(model.state_dict())
    raw = copy.tok_emb(idx) + copy.pos_emb(torch.arange(16))
    raw.retain_grad()
    h = copy.norm_embed(raw)
    normed = h.detach().clone()
    for block in copy.blocks:
        h = block(h)
    copy.head(copy.norm_f(h)).mean().backward()
    before = [p.detach().clone() for p in norm.parameters()]

    stats = probe_one_step(model, idx)
    assert stats["act/embed_rms"] == pytest.approx(rms(raw), rel=1e-5)
    assert stats["act/embed_max"] == pytest.approx(raw.abs().max().item(), rel=1e-6)
    assert stats["grad/embed_rms"] == pytest.approx(rms(raw.grad), rel=1e-4)
    assert stats["act/norm_in_rms/norm_embed"] == pytest.approx(rms(raw), rel=1e-5)
    assert stats["act/norm_out_rms/norm_embed"] == pytest.approx(rms(normed), rel=1e-5)
    assert abs(stats["act/norm_out_rms/norm_embed"] / stats["act/embed_rms"] - 1) > 0.1  # the norm does change it
    assert stats["norm/alpha/norm_embed"] == pytest.approx(0.7)
    assert stats["norm/shift/norm_embed"] == pytest.approx(0.3)
    assert stats["norm/gain_mean/norm_embed"] == pytest.approx(1.0)
    assert stats["norm/gain_std/norm_embed"] == pytest.approx(torch.linspace(0.5, 1.5, 32).std(correction=0).item())
    assert stats["norm/shift/L00/norm1"] == 0.0  # Derf's shift wherever α is logged
    assert stats["grad/norm_embed_norm"] == pytest.approx(l2(p.grad for p in copy.norm_embed.parameters()), rel=1e-4)
    change = l2(p - b for p, b in zip(norm.parameters(), before)) / l2(before)
    assert stats["update_ratio/norm_embed"] == pytest.approx(change, rel=1e-5) and change > 0
