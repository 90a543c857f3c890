"""The 2024–2026 arms: placement=reordered and lns, embed_norm, final_norm, residual gates, norm=derf,
qk_norm_axis and qk_norm_gains, attn_softcap and z_loss. Each formula against a hand computation on a fixed
tensor; their validation, run names and bookkeeping."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from normlab.config import ConfigError, NormConfig, RunConfig, bookkeeping_keys
from normlab.nn.model import GPT, block_slots, gate_init, uses_final_norm
from normlab.nn.norms import Derf, LayerNorm, RMSNorm, build_norm
from normlab.nn.sublayers import softcapped_attention
from normlab.train.loop import accumulate_gradients, loss_fn, z_loss_term

NEW_KEYS = ("embed_norm", "final_norm", "residual_gate", "residual_gate_init", "qk_norm_axis", "qk_norm_gains",
            "attn_softcap", "z_loss", "norm.shift")


def _fixed(*shape: int) -> torch.Tensor:
    """A fixed tensor of varied values: no random state."""
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32).mul(0.37).sin() * 2.5).reshape(shape)


# ---------------------------------------------------------------- Derf


def test_derf_is_gamma_erf_alpha_x_plus_s_plus_beta():
    derf = Derf(4, alpha=0.7, shift=0.2)
    with torch.no_grad():
        derf.weight.copy_(torch.tensor([1.0, -0.5, 2.0, 0.25]))
        derf.bias.copy_(torch.tensor([0.0, 0.1, -0.3, 1.0]))
    x = _fixed(3, 4)
    hand = [[derf.weight[j].item() * math.erf(0.7 * x[i, j].item() + 0.2) + derf.bias[j].item() for j in range(4)]
            for i in range(3)]
    torch.testing.assert_close(derf(x), torch.tensor(hand), rtol=1e-6, atol=1e-6)


def test_derf_defaults_knobs_and_learnable_scalars():
    cfg = NormConfig(name="derf", alpha_attn=0.9, alpha_mlp=0.3, alpha_final=0.1, shift=-0.2)
    for role, alpha in (("attn", 0.9), ("mlp", 0.3), ("final", 0.1)):
        norm = build_norm(cfg, 6, role)
        assert isinstance(norm, Derf) and norm.alpha.item() == pytest.approx(alpha)
        assert norm.shift.item() == pytest.approx(-0.2)
    derf = build_norm(NormConfig(name="derf"), 6)
    assert derf.alpha.shape == derf.shift.shape == () and derf.alpha.item() == 0.5 and derf.shift.item() == 0.0
    assert torch.equal(derf.weight, torch.ones(6)) and torch.equal(derf.bias, torch.zeros(6))
    derf(_fixed(2, 6)).sum().backward()
    assert derf.alpha.grad.item() != 0 and derf.shift.grad.item() != 0
    plain = build_norm(NormConfig(name="derf", weight=False, bias=False), 6)
    assert plain.weight is None and plain.bias is None and NormConfig(name="derf", bias=False).label == "derf_nobias"


# ---------------------------------------------------------------- placements


def test_lns_scales_each_sublayers_pre_norm_output_by_one_over_sqrt_l_and_not_the_final_norm():
    torch.manual_seed(0)
    model = GPT(tiny_config("layer", "lns", depth=3))
    assert [b.slots.pre_scale for b in model.blocks] == pytest.approx([1, 1 / math.sqrt(2), 1 / math.sqrt(3)])
    assert [block_slots("lns", i, 3).pre for i in range(3)] == [True] * 3 and isinstance(model.norm_f, LayerNorm)
    x = _fixed(2, 8, 32)
    stream = x
    for l, block in enumerate(model.blocks, start=1):
        h = stream + block.attn(block.norm1(stream) / math.sqrt(l))
        expected = h + block.mlp(block.norm2(h) / math.sqrt(l))
        torch.testing.assert_close(block(stream), expected)
        stream = expected
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    pre = GPT(tiny_config("layer", "pre", depth=3))
    pre.load_state_dict(model.state_dict())  # the same weights, the same module tree
    assert torch.equal(model.blocks[0](x), pre.blocks[0](x))  # ℓ = 1: no scale
    assert not torch.allclose(model(tokens), pre(tokens))


def test_reordered_puts_the_norm_on_the_branch_output_only_and_keeps_the_final_norm():
    torch.manual_seed(0)
    model = GPT(tiny_config("rms", "reordered"))
    block = model.blocks[0]
    assert isinstance(block.norm1, nn.Identity) and isinstance(block.norm2, nn.Identity)
    assert isinstance(block.norm1_out, RMSNorm) and isinstance(model.norm_f, RMSNorm)
    with torch.no_grad():
        block.norm1_out.weight.copy_(torch.linspace(0.5, 2.0, 32))
        block.norm2_out.weight.copy_(torch.linspace(2.0, 0.5, 32))
    x = _fixed(2, 8, 32)
    h = x + block.norm1_out(block.attn(x))
    torch.testing.assert_close(block(x), h + block.norm2_out(block.mlp(h)))


# ---------------------------------------------------------------- embedding and final norms


def test_embed_norm_normalizes_token_plus_position_before_block_0():
    model = GPT(tiny_config("layer", embed_norm=True))
    assert isinstance(model.norm_embed, LayerNorm) and isinstance(GPT(tiny_config("layer")).norm_embed, nn.Identity)
    entering = {}
    model.blocks[0].register_forward_pre_hook(lambda m, args: entering.setdefault("x", args[0]))
    tokens = torch.tensor([[5, 6, 7, 8]])
    model(tokens)
    raw = model.tok_emb(tokens) + model.pos_emb(torch.arange(4))
    hand = (raw - raw.mean(-1, keepdim=True)) / torch.sqrt(raw.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(entering["x"], hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement,final_norm,expected", [
    ("pre", "auto", True), ("pre", False, False), ("post", "auto", False), ("post", True, True),
    ("reordered", "auto", True), ("lns", "auto", True), ("deepnorm", True, True), ("sandwich", False, False),
])
def test_final_norm_is_the_placements_default_unless_set(placement, final_norm, expected):
    cfg = tiny_config("rms", placement, final_norm=final_norm)
    assert uses_final_norm(cfg) == expected
    assert isinstance(GPT(cfg).norm_f, RMSNorm if expected else nn.Identity)


# ---------------------------------------------------------------- residual gates


def test_rezero_is_x_plus_a_f_x_with_a_scalar_a_that_starts_at_0():
    torch.manual_seed(0)
    block = GPT(tiny_config("none", "pre", residual_gate="rezero")).blocks[0]
    assert block.gate1.weight.shape == () and block.gate1.weight.item() == 0.0
    x = _fixed(2, 8, 32)
    assert torch.equal(block(x), x)  # the identity at init
    with torch.no_grad():
        block.gate1.weight.fill_(0.3)
        block.gate2.weight.fill_(-0.7)
    h = x + 0.3 * block.attn(x)
    torch.testing.assert_close(block(x), h - 0.7 * block.mlp(h))


def test_docs_norms_claims_of_olmo_2_and_rezero_match_the_model():
    """OLMo 2 has no embedding norm, so the example of its choices sets none; normlab's ReZero has one α per
    sublayer (two learnable scalars per block) where the paper's reference code shares one per layer, and
    the switches table says so."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "norms.md").read_text()
    olmo2 = next(line for line in text.splitlines() if "OLMo 2's choices" in line)
    assert "placement=reordered" in olmo2 and "qk_norm_axis=all" in olmo2 and "embed_norm" not in olmo2
    gates = [m for m in GPT(tiny_config("none", "pre", residual_gate="rezero")).blocks[0].modules()
             if type(m).__name__ == "ResidualGate"]
    assert len(gates) == 2 and all(g.weight.shape == () for g in gates)
    rezero = next(line for line in text.splitlines() if line.startswith("| `residual_gate=rezero`"))
    assert "one per sublayer" in rezero and "one α per layer" in rezero


def test_layerscale_is_x_plus_lambda_times_f_of_the_normed_x_per_feature():
    torch.manual_seed(0)
    block = GPT(tiny_config("layer", "pre", residual_gate="layerscale")).blocks[0]
    assert block.gate1.weight.shape == (32,) and torch.equal(block.gate1.weight, torch.full((32,), 0.1))
    lam1, lam2 = torch.linspace(-1, 1, 32), torch.linspace(0.2, 0.4, 32)
    with torch.no_grad():
        block.gate1.weight.copy_(lam1)
        block.gate2.weight.copy_(lam2)
    x = _fixed(2, 8, 32)
    h = x + lam1 * block.attn(block.norm1(x))
    torch.testing.assert_close(block(x), h + lam2 * block.mlp(block.norm2(h)))


@pytest.mark.parametrize("gate,depth,init,expected", [
    ("rezero", 4, None, 0.0), ("layerscale", 18, None, 0.1), ("layerscale", 19, None, 1e-5),
    ("layerscale", 24, None, 1e-5), ("layerscale", 25, None, 1e-6), ("layerscale", 4, 1e-4, 1e-4), ("rezero", 4, 0.5, 0.5),
])
def test_gate_init_is_the_methods_own_unless_set(gate, depth, init, expected):
    assert gate_init(RunConfig(residual_gate=gate, depth=depth, residual_gate_init=init)) == expected


# ---------------------------------------------------------------- attention


def test_softcapped_attention_by_hand():
    q, k, v = _fixed(1, 1, 3, 2) * 4, _fixed(1, 1, 3, 2).flip(-1) * 3, _fixed(1, 1, 3, 2) + 1
    cap = 2.0
    out = softcapped_attention(q, k, v, cap)
    for t in range(3):
        logits = [cap * math.tanh(sum(q[0, 0, t, i].item() * k[0, 0, s, i].item() for i in range(2)) / math.sqrt(2) / cap)
                  for s in range(t + 1)]
        weights = [math.exp(a) / sum(math.exp(b) for b in logits) for a in logits]
        hand = [sum(w * v[0, 0, s, i].item() for s, w in enumerate(weights)) for i in range(2)]
        torch.testing.assert_close(out[0, 0, t], torch.tensor(hand), rtol=1e-5, atol=1e-6)
    # A cap far above every logit is plain scaled dot-product attention.
    torch.testing.assert_close(softcapped_attention(q, k, v, 1e6), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_attn_softcap_reaches_the_model_and_null_keeps_sdpa():
    torch.manual_seed(0)
    capped = GPT(tiny_config("layer", attn_softcap=0.5))
    plain = GPT(tiny_config("layer"))
    plain.load_state_dict(capped.state_dict())
    assert capped.blocks[0].attn.softcap == 0.5 and plain.blocks[0].attn.softcap is None
    x = _fixed(2, 8, 32) * 20  # logits well above the cap
    assert not torch.allclose(capped.blocks[0].attn(x), plain.blocks[0].attn(x))


def test_qk_norm_axis_all_normalizes_the_whole_projection_before_the_heads():
    torch.manual_seed(0)
    attn = GPT(tiny_config("rms", qk_norm=True, qk_norm_axis="all")).blocks[0].attn
    assert attn.q_norm.weight.shape == (32,)  # a gain per feature of the whole projection
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x = _fixed(2, 5, 32)
    q, _, _ = attn.heads(x)
    raw = attn.qkv(x)[..., :32]  # (B, T, C) before the split into 2 heads of 16
    hand = raw / torch.sqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.q_norm.weight
    torch.testing.assert_close(q, hand.view(2, 5, 2, 16).transpose(1, 2))
    unit = q.transpose(1, 2).reshape(2, 5, 32) / attn.q_norm.weight  # unit RMS over the 32 features, not per head
    torch.testing.assert_close(unit.pow(2).mean(-1), torch.ones(2, 5), rtol=1e-3, atol=1e-3)  # ε = 1e-5 in the root
    assert not torch.allclose(unit.view(2, 5, 2, 16).pow(2).mean(-1), torch.ones(2, 5, 2), atol=1e-2)


@pytest.mark.parametrize("norm", ["layer", "rms", "scale", "dyt", "derf"])
def test_qk_norm_gains_head_gives_each_head_its_own_gain(norm):
    torch.manual_seed(0)
    attn = GPT(tiny_config(norm, qk_norm=True, qk_norm_gains="head")).blocks[0].attn
    gain_name = "g" if norm == "scale" else "weight"
    gain = getattr(attn.q_norm, gain_name)
    assert gain.shape == ((2, 1, 1) if norm == "scale" else (2, 1, 16))
    with torch.no_grad():
        gain.copy_(torch.tensor([0.5, 3.0]).view(2, 1, 1).expand_as(gain))
    x = _fixed(2, 5, 32)
    q, _, _ = attn.heads(x)
    raw = attn.qkv(x)[..., :32].view(2, 5, 2, 16).transpose(1, 2)
    shared = build_norm(tiny_config(norm, qk_norm=True).qk_norm_config(), 16)
    if getattr(attn.q_norm, "bias", None) is not None:
        shared.bias = None  # the per-head shifts stay 0 here: compare the gains alone
    if hasattr(shared, "alpha"):
        shared.alpha = attn.q_norm.alpha
    with torch.no_grad():
        getattr(shared, gain_name).fill_(1.0)
    for head, g in enumerate((0.5, 3.0)):
        torch.testing.assert_close(q[:, head], g * shared(raw[:, head]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- z-loss


def test_z_loss_term_is_c_times_the_mean_squared_log_partition_function():
    logits = _fixed(2, 3, 5)
    hand = [math.log(sum(math.exp(logits[b, t, i].item()) for i in range(5))) ** 2 for b in range(2) for t in range(3)]
    assert z_loss_term(logits, 1e-2).item() == pytest.approx(1e-2 * sum(hand) / 6, rel=1e-6)


def test_the_objective_adds_the_z_loss_and_the_returned_loss_stays_the_cross_entropy():
    cfg = tiny_config("layer")
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    grads, losses = {}, {}
    for c in (0.0, 0.5):
        torch.manual_seed(0)
        model = GPT(cfg)
        terms = {}
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        losses[c] = accumulate_gradients(model, x, x, 2, scaler, torch.device("cpu"), "fp32", c, terms)
        grads[c] = model.head.weight.grad.clone()
        assert set(terms) == ({"z_loss"} if c else set())
    torch.manual_seed(0)
    model = GPT(cfg)
    logits = model(x)
    (loss_fn(logits, x) + z_loss_term(logits, 0.5)).backward()
    torch.testing.assert_close(grads[0.5], model.head.weight.grad, rtol=1e-4, atol=1e-7)
    assert losses[0.5].item() == pytest.approx(losses[0.0].item(), rel=1e-6)  # the same weights: the same CE
    assert not torch.allclose(grads[0.5], grads[0.0])


# ---------------------------------------------------------------- names, bookkeeping, refusals


def test_default_run_names_are_unchanged_and_each_new_key_shows_in_the_name():
    assert RunConfig().run_name == "layer-pre-d4-lr3e-3-s0"
    assert RunConfig(qk_norm=True, placement="mix").run_name == "layer-mix0.25-qk-d4-lr3e-3-s0"
    arms = [dict(placement="reordered"), dict(placement="lns"), dict(embed_norm=True), dict(final_norm=True),
            dict(final_norm=False), dict(residual_gate="rezero"), dict(residual_gate="rezero", residual_gate_init=0.1),
            dict(residual_gate="layerscale"), dict(qk_norm=True), dict(qk_norm=True, qk_norm_axis="all"),
            dict(qk_norm=True, qk_norm_gains="head"), dict(attn_softcap=50.0), dict(z_loss=1e-4), dict(z_loss=1e-3)]
    names = [RunConfig.from_dict(arm).run_name for arm in arms]
    assert len(set(names)) == len(names) and RunConfig().run_name not in names
    assert names[1] == "layer-lns-d4-lr3e-3-s0" and names[6] == "layer-pre-rezero0.1-d4-lr3e-3-s0"
    assert names[9] == "layer-pre-qk_all-d4-lr3e-3-s0" and names[11] == "layer-pre-cap50-d4-lr3e-3-s0"
    assert names[12] == "layer-pre-z1e-4-d4-lr3e-3-s0"
    assert RunConfig.from_dict({"norm": {"name": "derf"}}).run_name == "derf-pre-d4-lr3e-3-s0"


def test_the_new_keys_change_results_so_none_is_bookkeeping():
    assert not set(NEW_KEYS) & set(bookkeeping_keys())


@pytest.mark.parametrize("raw,message", [
    ({"norm": {"name": "none"}, "embed_norm": True}, "embed_norm=true with norm=none: there is no norm"),
    ({"norm": {"name": "batch", "causal": True}, "embed_norm": True}, "embed_norm=true with norm=batch_causal"),
    ({"norm": {"name": "none"}, "final_norm": True}, "final_norm=true with norm=none"),
    ({"final_norm": "yes"}, "final_norm='yes' is not allowed: choose auto"),
    ({"residual_gate": "gated"}, "residual_gate='gated' is not allowed: choose one of none, rezero, layerscale"),
    ({"residual_gate_init": 0.1}, "residual_gate_init=0.1 with residual_gate=none"),
    ({"qk_norm_axis": "all"}, "qk_norm_axis=all with qk_norm=false"),
    ({"qk_norm": True, "qk_norm_axis": "row"}, "qk_norm_axis='row' is not allowed: choose one of head, all"),
    ({"qk_norm_gains": "head"}, "qk_norm_gains=head with qk_norm=false"),
    ({"qk_norm": True, "qk_norm_axis": "all", "qk_norm_gains": "head"}, "qk_norm_gains=head with qk_norm_axis=all"),
    ({"qk_norm": True, "qk_norm_gains": "head", "norm": {"name": "rms", "weight": False}}, "norm=rms_noweight: its QK-norm has no gain"),
    ({"attn_softcap": 0.0}, "attn_softcap=0.0: must be a positive number, or null"),
    ({"z_loss": -1e-4}, "z_loss=-0.0001: must be >= 0"),
    ({"norm": {"name": "layer", "shift": 0.5}}, "norm.shift=0.5: norm=layer has no knob 'shift'"),
    ({"norm": {"name": "derf", "alpha_mlp": 0.0}}, "norm.alpha_mlp=0.0: must be a positive number"),
])
def test_what_makes_no_sense_is_refused_in_one_line(raw, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_sensible_new_combinations_pass():
    for raw in ({"norm": {"name": "none"}, "placement": "lns"}, {"norm": {"name": "none"}, "residual_gate": "rezero"},
                {"norm": {"name": "batch"}, "placement": "reordered", "embed_norm": True},
                {"norm": {"name": "scale"}, "qk_norm": True, "qk_norm_gains": "head"},
                {"norm": {"name": "derf"}, "placement": "deepnorm", "qk_norm": True, "qk_norm_axis": "all"},
                {"placement": "post", "final_norm": True, "residual_gate": "layerscale", "residual_gate_init": 1e-4}):
        RunConfig.from_dict(raw)
