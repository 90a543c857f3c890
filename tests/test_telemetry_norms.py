"""Telemetry of the norms themselves: the embedding norm observed like every other norm (its input, its
parameters, Derf's shift), and norms whose ε dominates their input (norm/eps_ratio, the run's warning and
compare's)."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_config
from normlab.analysis.stats.comparison import build_comparison
from normlab.analysis.render.ranking import terminal_summary
from normlab.config import TelemetryConfig
from normlab.nn.model import GPT
from normlab.nn.norms import BatchNorm, Derf, DyT, L2Norm, LayerNorm, RMSNorm, ScaleNorm
from normlab.train.pack.loop import PackLoop
from normlab.telemetry.probe import Probe
from normlab.telemetry.norms import EPS_RATIO, EpsWarnings
from test_telemetry import run


def rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def l2(tensors) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in tensors))


def probe_one_step(model: GPT, idx: torch.Tensor, lr: float = 1e-2) -> dict[str, float]:
    """One watched forward, backward (loss: the mean logit) and AdamW step of `model`; its statistics."""
    probe = Probe(model, every=1, max_steps=1)
    probe.forward(idx).mean().backward()
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


# ---------------------------------------------------------------- eps-dominated norms


def test_eps_rms_is_where_eps_equals_the_inputs_mean_square():
    """√ε for a norm that adds ε to a mean square or variance; ε/√d for one that bounds ‖x‖ by ε; none without ε.
    An RMSNorm input of RMS √ε comes out at RMS sqrt(ms / (ms + ε)) = 1/√2, not 1."""
    assert LayerNorm(8, eps=1e-4).eps_rms() == pytest.approx(1e-2)
    assert RMSNorm(8, eps=1e-6).eps_rms() == pytest.approx(1e-3)
    assert BatchNorm(8, eps=4e-6).eps_rms() == pytest.approx(2e-3)
    assert ScaleNorm(16, eps=1e-3).eps_rms() == pytest.approx(1e-3 / 4)
    assert L2Norm(16, eps=1e-3).eps_rms() == pytest.approx(1e-3 / 4)
    assert DyT(8).eps_rms() is None and Derf(8).eps_rms() is None
    norm = RMSNorm(64, eps=1e-4, weight=False)
    x = torch.randn(5, 64, dtype=torch.float64)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * norm.eps_rms()  # every token at RMS √ε
    assert rms(norm(x)) == pytest.approx(1 / math.sqrt(2), rel=1e-6)


def test_an_eps_dominated_norm_scales_by_the_gain_the_docs_give():
    """docs/telemetry.md, norm/eps_ratio, with r = input RMS / eps_rms and unit gains. RMSNorm, LayerNorm and
    BatchNorm: output RMS at most r/sqrt(1 + r^2) (about r below 1), equal for RMSNorm when every token has one
    RMS, whose gain is then 1/sqrt(ms + eps), 1/sqrt(eps) as r -> 0. ScaleNorm: below 1, exactly x·g/eps and
    output RMS g·r/sqrt(d) (r at g = sqrt(d)); above 1, g/sqrt(d). L2: x/eps, output RMS r/sqrt(d)."""
    d, eps = 32, 1e-4
    x = torch.randn(6, 5, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x * torch.linspace(0.2, 2.0, 5, dtype=torch.float64)[:, None]  # tokens of unequal RMS
    same = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # every token at RMS 1
    for r in (0.01, 0.5, 1.0, 3.0):
        for norm in (RMSNorm(d, eps, weight=False), LayerNorm(d, eps, weight=False, bias=False),
                     BatchNorm(d, eps, weight=False, bias=False)):
            assert rms(norm(x * (r * norm.eps_rms() / rms(x)))) <= r / math.sqrt(1 + r * r) * (1 + 1e-6), (norm, r)
        rms_norm = RMSNorm(d, eps, weight=False)
        equal = same * r * rms_norm.eps_rms()
        assert rms(rms_norm(equal)) == pytest.approx(r / math.sqrt(1 + r * r), rel=1e-5)
        torch.testing.assert_close(rms_norm(equal), equal / math.sqrt((r * r + 1) * eps), rtol=1e-5, atol=0)
        scale, unit = ScaleNorm(d, eps), L2Norm(d, eps)
        tokens = same * r * scale.eps_rms()  # ‖x‖ = r·eps for every token
        if r < 1:
            torch.testing.assert_close(scale(tokens), tokens * math.sqrt(d) / eps, rtol=1e-5, atol=0)
            torch.testing.assert_close(unit(tokens), tokens / eps, rtol=1e-5, atol=0)
        assert rms(scale(tokens)) == pytest.approx(min(r, 1.0), rel=1e-5)  # g = sqrt(d): g·r/sqrt(d) = r below 1
        assert rms(unit(tokens)) == pytest.approx(min(r, 1.0) / math.sqrt(d), rel=1e-5)


def test_eps_ratio_is_the_input_rms_over_sqrt_eps_and_the_warning_names_each_dominated_slot_once():
    """The tiny model under placement=reordered at init (GPT-2's N(0, 0.02) weights, width 32): every branch
    norm's input is a sublayer's output far below sqrt(1e-5); the final norm reads the stream, far above it."""
    torch.manual_seed(0)
    stats = probe_one_step(GPT(tiny_config("layer", "reordered")),
                           torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    ratios = {k.removeprefix(f"{EPS_RATIO}/"): v for k, v in stats.items() if k.startswith(EPS_RATIO)}
    branch = ["L00/norm1_out", "L00/norm2_out", "L01/norm1_out", "L01/norm2_out"]
    assert set(ratios) == {*branch, "norm_f"}
    for loc, ratio in ratios.items():
        assert ratio == pytest.approx(stats[f"act/norm_in_rms/{loc}"] / math.sqrt(1e-5), rel=1e-9), loc
    assert max(ratios[loc] for loc in branch) < 1 < ratios["norm_f"]
    warnings = EpsWarnings()
    line = warnings.line(stats, 0)
    assert all(f" {loc} (" in line for loc in branch) and "norm_f" not in line and "\n" not in line
    assert warnings.line(stats, 10) is None  # named once per run, not at every telemetry step


def test_a_run_logs_one_line_per_eps_dominated_slot_and_compare_warns_of_its_arm(tmp_path, text_data, caplog):
    """norm.eps=1 puts sqrt(eps) above every pre-norm input at init (the embedding's RMS is about 0.02): the
    run names its slots in one warning line; the default eps gives none, and compare warns of that arm alone."""
    lines = {}
    for eps in (1.0, 1e-5):
        cfg = tiny_config("layer", "pre", data=text_data, max_steps=3, eval_every=0, telemetry=TelemetryConfig(every=1))
        cfg.norm.eps = eps
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="normlab"):
            run(cfg, tmp_path, f"eps{eps:g}")
        lines[eps] = [r.getMessage() for r in caplog.records if "eps-dominated" in r.getMessage()]
    assert lines[1e-5] == [] and len(lines[1.0]) >= 1
    assert lines[1.0][0].startswith("eps-dominated norms at step 0,")  # the telemetry step's own, though read in step 1
    named = [slot for line in lines[1.0] for slot in ("L00/norm1", "L00/norm2", "L01/norm1", "norm_f") if f" {slot} (" in line]
    assert sorted(named) == ["L00/norm1", "L00/norm2", "L01/norm1", "norm_f"]  # every slot, each once
    comparison = build_comparison([tmp_path / "eps1", tmp_path / "eps1e-05"])
    assert len(comparison.eps_warnings) == 1 and "L00/norm1 (step 0" in comparison.eps_warnings[0]
    assert sorted(a.arm.label for a in comparison.arms) == ["norm.eps=1.0", "norm.eps=1e-05"]
    assert comparison.eps_warnings[0].startswith("norm.eps=1.0: eps-dominated norms")
    assert f"warning: {comparison.eps_warnings[0]}" in terminal_summary(comparison)


def test_a_pack_warns_for_each_member_with_an_eps_dominated_norm(caplog):
    """The packed loop logs a member's warning under its run name, as its unpacked run would, once per slot."""
    loop = SimpleNamespace(eps_warnings=[EpsWarnings(), EpsWarnings()], members=[SimpleNamespace(active=True)] * 2,
                           cfgs=[SimpleNamespace(run_name="a-s0"), SimpleNamespace(run_name="a-s1")])
    stats = [{f"{EPS_RATIO}/L00/norm1_out": 0.03, f"{EPS_RATIO}/norm_f": 90.0}, {f"{EPS_RATIO}/L00/norm1_out": 2.0}]
    with caplog.at_level(logging.WARNING, logger="normlab"):
        PackLoop._warn_eps(loop, 0, stats)
        PackLoop._warn_eps(loop, 10, stats)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("a-s0: eps-dominated norms at step 0") and "L00/norm1_out (0.03)" in lines[0]
