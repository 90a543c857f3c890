"""The GPT: module names, placements, tied head, and causal evaluation for every norm × placement."""

import math

import pytest
import torch
from torch import nn

from conftest import tiny_config
from normlab.config import NORMS, PLACEMENTS, ConfigError, NormConfig
from normlab.nn.model import GPT, block_slots, deepnorm_alpha, deepnorm_beta, has_final_norm, mix_post_blocks
from normlab.nn.norms import CausalBatchNorm, DyT, L2Norm, LayerNorm, RMSNorm, ScaleNorm

# Every norm, with BatchNorm's causal option as one more.
NORM_ARMS = [*NORMS, "batch_causal"]


def arm_config(norm: str, placement: str = "pre", **overrides):
    """tiny_config for a norm arm ('batch_causal' = norm=batch norm.causal=true); None if validation rejects it."""
    try:
        cfg = tiny_config(norm.removesuffix("_causal"), placement, **overrides)
        cfg.norm.causal = norm.endswith("_causal")
        cfg.validate()
    except ConfigError:
        return None
    return cfg


VALID_ARMS = [(n, p) for n in NORM_ARMS for p in PLACEMENTS if arm_config(n, p) is not None]


def test_only_deepnorm_without_a_norm_is_left_out():
    assert set(VALID_ARMS) == {(n, p) for n in NORM_ARMS for p in PLACEMENTS} - {("none", "deepnorm")}


@pytest.mark.parametrize("norm,placement", VALID_ARMS)
def test_eval_mode_is_causal(norm, placement):
    torch.manual_seed(0)
    model = GPT(arm_config(norm, placement))
    if norm.startswith("batch"):  # give the running statistics non-trivial values first
        model.train()
        model(torch.randint(0, 256, (8, 16)))
    model.eval()
    idx = torch.randint(0, 256, (3, 16))
    t = 7
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, 256, (3, 16 - t - 1))
    assert not torch.equal(idx[:, t + 1 :], changed[:, t + 1 :])
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the change did reach later positions


def training_mode_leak(model: GPT, t: int) -> tuple[float, float]:
    """In training mode, change every token after position t; return the largest change in the logits
    at positions ≤ t (the leak) and after t (showing the change reached the model)."""
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 16), generator=gen)
    changed = idx.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + torch.randint(0, 255, (4, 16 - t - 1), generator=gen)) % 256
    model.train()
    with torch.no_grad():
        a, b = model(idx), model(changed)
    return (a[:, : t + 1] - b[:, : t + 1]).abs().max().item(), (a[:, t + 1 :] - b[:, t + 1 :]).abs().max().item()


@pytest.mark.parametrize("norm,placement", VALID_ARMS)
def test_training_mode_leak_is_measured_nonzero_for_batch_norm_only(norm, placement):
    """BatchNorm's batch × time statistics carry later tokens into earlier positions in training mode;
    per-token norms and causal BatchNorm (per-position statistics) leave the logits at ≤ t exactly unchanged."""
    torch.manual_seed(0)
    leak, downstream = training_mode_leak(GPT(arm_config(norm, placement)), t=9)
    assert downstream > 1e-3
    if norm == "batch":
        assert leak > 1e-4, f"BatchNorm training-mode leak {leak:.2e}"
    else:
        assert leak == 0.0, f"{norm}-{placement} leaks {leak:.2e} in training mode"


def test_module_names_are_stable_across_arms():
    names = {}
    for norm, placement in VALID_ARMS:
        for qk_norm in (False, True):
            cfg = arm_config(norm, placement, qk_norm=qk_norm)
            if cfg is not None:
                names[norm, placement, qk_norm] = {n for n, _ in GPT(cfg).named_modules()}
    assert len(names) == 2 * len(VALID_ARMS) - 3 * len(PLACEMENTS)  # no QK-norm for batch, batch_causal, l2
    first = next(iter(names.values()))
    assert all(n == first for n in names.values())
    for expected in (
        "blocks.1.attn",
        "blocks.1.mlp",
        "blocks.1.norm1",
        "blocks.1.norm1_out",
        "blocks.1.norm2",
        "blocks.1.norm2_out",
        "blocks.1.attn.q_norm",
        "blocks.1.attn.k_norm",
        "blocks.1.gate1",
        "blocks.1.gate2",
        "norm_embed",
        "norm_f",
        "tok_emb",
    ):
        assert expected in first


def test_placements_fill_the_right_slots():
    pre = GPT(tiny_config("layer", "pre"))
    post = GPT(tiny_config("layer", "post"))
    assert isinstance(pre.norm_f, LayerNorm) and isinstance(post.norm_f, nn.Identity)
    assert pre.blocks[0].slots.pre and not pre.blocks[0].slots.post
    assert post.blocks[0].slots.post and not post.blocks[0].slots.pre


def test_post_placement_normalizes_the_residual_stream():
    """Post-LN: each block's output is a LayerNorm output (zero mean, unit variance per token)."""
    model = GPT(tiny_config("layer", "post")).eval()
    for block in model.blocks:
        for norm in (block.norm1, block.norm2):
            nn.init.ones_(norm.weight), nn.init.zeros_(norm.bias)
    x = torch.randn(2, 16, 32)
    y = model.blocks[0](x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 16), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 16), atol=1e-3, rtol=0)


def test_pre_placement_block_by_hand():
    torch.manual_seed(0)
    block = GPT(tiny_config("rms", "pre")).blocks[0]
    x = torch.randn(2, 16, 32)
    h = x + block.attn(block.norm1(x))
    expected = h + block.mlp(block.norm2(h))
    torch.testing.assert_close(block(x), expected)


def test_head_is_tied_and_init_schemes_differ():
    normal = GPT(tiny_config(init="normal"))
    assert normal.head.weight is normal.tok_emb.weight
    proj_std = normal.blocks[0].mlp.proj.weight.std().item()
    fc_std = normal.blocks[0].mlp.fc.weight.std().item()
    assert abs(fc_std - 0.02) < 0.003
    assert abs(proj_std - 0.02 / 2) < 0.002  # 1/sqrt(2·depth) with depth 2
    xavier = GPT(tiny_config(init="xavier"))
    bound = (6 / (32 + 128)) ** 0.5
    w = xavier.blocks[0].mlp.fc.weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert torch.count_nonzero(xavier.blocks[0].mlp.fc.bias) == 0


# ---------------------------------------------------------------- sandwich, deepnorm, mix


def test_sandwich_block_by_hand():
    """x ← x + Norm_out(f(Norm_in(x))) per sublayer, with separate in and out norms, and a final norm."""
    torch.manual_seed(0)
    model = GPT(tiny_config("rms", "sandwich"))
    block = model.blocks[0]
    assert isinstance(block.norm1_out, RMSNorm) and isinstance(block.norm2_out, RMSNorm)
    assert block.norm1_out is not block.norm1 and isinstance(model.norm_f, RMSNorm)
    with torch.no_grad():  # distinct gains, so swapping the in and out norms would show
        for i, norm in enumerate((block.norm1, block.norm1_out, block.norm2, block.norm2_out)):
            norm.weight.copy_(torch.linspace(0.5, 2.0, 32) * (i + 1))
    x = torch.randn(2, 16, 32)
    h = x + block.norm1_out(block.attn(block.norm1(x)))
    expected = h + block.norm2_out(block.mlp(block.norm2(h)))
    torch.testing.assert_close(block(x), expected)
    assert not torch.allclose(block(x), GPT(tiny_config("rms", "pre")).blocks[0](x))


def test_deepnorm_block_by_hand():
    """x ← Norm(α·x + f(x)) with α = (2N)^(1/4), N the number of blocks; no final norm."""
    torch.manual_seed(0)
    model = GPT(tiny_config("layer", "deepnorm", depth=3))
    block = model.blocks[1]
    alpha = (2 * 3) ** 0.25
    assert block.slots.alpha == pytest.approx(alpha) and deepnorm_alpha(3) == pytest.approx(alpha)
    assert isinstance(model.norm_f, nn.Identity) and isinstance(block.norm1_out, nn.Identity)
    x = torch.randn(2, 16, 32) * 3
    h = block.norm1(alpha * x + block.attn(x))
    expected = block.norm2(alpha * h + block.mlp(h))
    torch.testing.assert_close(block(x), expected)


@pytest.mark.parametrize("init", ["normal", "xavier"])
def test_deepnorm_init_scales_value_output_and_mlp_weights_by_beta(init):
    """DeepNorm's β = (8N)^(-1/4) multiplies the init of v, the attention output and both MLP
    weights, on top of the scheme; q and k are left as the scheme makes them."""
    depth = 3
    beta = (8 * depth) ** -0.25
    assert deepnorm_beta(depth) == pytest.approx(beta)
    torch.manual_seed(0)
    post = GPT(tiny_config("layer", "post", depth=depth, init=init))
    torch.manual_seed(0)
    deep = GPT(tiny_config("layer", "deepnorm", depth=depth, init=init))
    C = 32
    for bp, bd in zip(post.blocks, deep.blocks):
        torch.testing.assert_close(bd.attn.qkv.weight[: 2 * C], bp.attn.qkv.weight[: 2 * C], rtol=0, atol=0)
        torch.testing.assert_close(bd.attn.qkv.weight[2 * C :], beta * bp.attn.qkv.weight[2 * C :])
        for name in ("attn.proj", "mlp.fc", "mlp.proj"):
            wd, wp = bd.get_submodule(name).weight, bp.get_submodule(name).weight
            torch.testing.assert_close(wd, beta * wp)
    torch.testing.assert_close(deep.tok_emb.weight, post.tok_emb.weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "depth,p,n_post", [(8, 0.25, 2), (4, 0.25, 1), (3, 0.25, 0), (6, 0.5, 3), (5, 0.0, 0), (5, 1.0, 5), (100, 0.29, 29)]
)
def test_mix_is_post_for_the_first_floor_pL_blocks_then_pre(depth, p, n_post):
    assert mix_post_blocks(depth, p) == n_post
    slots = [block_slots("mix", i, depth, p) for i in range(depth)]
    assert [s.post for s in slots] == [True] * n_post + [False] * (depth - n_post)
    assert all(s.pre != s.post and s.alpha == 1.0 and not s.branch for s in slots)
    assert has_final_norm("mix", depth, p) == (n_post < depth)  # the last block is pre-norm


def test_mix_model_normalizes_after_the_early_blocks_and_before_the_late_ones():
    torch.manual_seed(0)
    model = GPT(tiny_config("layer", "mix", depth=4, mix_p=0.5))
    assert [b.slots.post for b in model.blocks] == [True, True, False, False]
    assert isinstance(model.norm_f, LayerNorm)
    assert isinstance(GPT(tiny_config("layer", "mix", depth=4, mix_p=1.0)).norm_f, nn.Identity)


def test_final_norm_follows_from_the_last_block():
    assert has_final_norm("pre") and has_final_norm("sandwich") and has_final_norm("mix", 4, 0.25)
    assert not has_final_norm("post") and not has_final_norm("deepnorm", 4)


# ---------------------------------------------------------------- QK-norm


@pytest.mark.parametrize(
    "norm,expected", [("layer", LayerNorm), ("rms", RMSNorm), ("dyt", DyT), ("scale", ScaleNorm), ("none", RMSNorm)]
)
def test_qk_norm_normalizes_each_head_with_the_norm_type(norm, expected):
    torch.manual_seed(0)
    model = GPT(tiny_config(norm, "pre", qk_norm=True))
    attn = model.blocks[0].attn
    assert isinstance(attn.q_norm, expected) and isinstance(attn.k_norm, expected)
    assert attn.q_norm is not attn.k_norm
    head_dim = 16
    if hasattr(attn.q_norm, "weight") and attn.q_norm.weight is not None:
        assert attn.q_norm.weight.shape == (head_dim,)  # per head, over head_dim, shared by the heads
    x = torch.randn(2, 5, 32)
    q, k, v = attn.heads(x)
    raw = attn.qkv(x).view(2, 5, 3, 2, head_dim).permute(2, 0, 3, 1, 4)  # (q|k|v, B, head, T, head_dim)
    torch.testing.assert_close(q, attn.q_norm(raw[0]))
    torch.testing.assert_close(k, attn.k_norm(raw[1]))
    torch.testing.assert_close(v, raw[2])
    if norm in ("layer", "rms", "none"):  # each head's query is normalized over its own head_dim
        rms = q.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)


def test_qk_norm_off_leaves_queries_and_keys_alone():
    attn = GPT(tiny_config("layer", "pre")).blocks[0].attn
    assert isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)


def test_dyt_alpha_initial_values_follow_the_slot():
    cfg = tiny_config("dyt", "sandwich", qk_norm=True)
    cfg.norm = NormConfig(name="dyt", alpha_attn=0.9, alpha_mlp=0.3, alpha_final=0.1)
    model = GPT(cfg)
    block = model.blocks[1]
    for module, alpha in [
        (block.norm1, 0.9),
        (block.norm1_out, 0.9),
        (block.attn.q_norm, 0.9),
        (block.attn.k_norm, 0.9),
        (block.norm2, 0.3),
        (block.norm2_out, 0.3),
        (model.norm_f, 0.1),
    ]:
        assert isinstance(module, DyT) and module.alpha.item() == pytest.approx(alpha)


def test_causal_batch_norm_keeps_statistics_for_every_position_of_the_context():
    model = GPT(arm_config("batch_causal", "pre"))
    assert isinstance(model.blocks[0].norm1, CausalBatchNorm)
    assert model.blocks[0].norm1.running_mean.shape == (32, 32)  # model.context × d_model
    assert isinstance(GPT(tiny_config("l2", "post")).blocks[0].norm1, L2Norm)


def test_embed_scale_multiplies_the_token_embedding_by_sqrt_d_and_leaves_the_head_alone():
    plain, scaled = GPT(tiny_config("layer")), GPT(tiny_config("layer"))
    scaled.load_state_dict(plain.state_dict())
    scaled.embed_scale = math.sqrt(scaled.tok_emb.embedding_dim)
    entering: dict[str, torch.Tensor] = {}
    for name, model in (("plain", plain), ("scaled", scaled)):
        model.blocks[0].register_forward_pre_hook(lambda m, args, name=name: entering.__setitem__(name, args[0]))
        model(torch.tensor([[1, 2, 3]]))
    pos = plain.pos_emb.weight[:3]
    d = plain.tok_emb.embedding_dim
    torch.testing.assert_close(entering["scaled"] - pos, (entering["plain"] - pos) * math.sqrt(d))
    assert scaled.head.weight is scaled.tok_emb.weight  # the head reads the unscaled matrix


def test_embed_scale_key_reaches_the_model():
    cfg = tiny_config("layer")
    assert GPT(cfg).embed_scale == 1.0
    cfg.model.embed_scale = True
    assert GPT(cfg).embed_scale == math.sqrt(cfg.model.d_model)


# ---------------------------------------------------------------- shifts a BatchNorm cancels


def _float64_gradients(cfg, monkeypatch) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one training-mode step, computed in float64 throughout (the norms'
    float32 casts too), with every parameter moved off its init so that a shift that matters shows."""
    monkeypatch.setattr(torch.Tensor, "float", torch.Tensor.double)
    torch.manual_seed(0)
    model = GPT(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    logits = model(x)
    nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "reordered", "mix", "lns", "deepnorm"])
@pytest.mark.parametrize("final_norm", ["auto", True, False])
def test_batch_norm_arms_build_no_shift_that_a_batch_norm_subtracts_again(placement, final_norm, monkeypatch):
    """Such a shift's gradient is exactly 0 (rounding noise in float32, which AdamW turns into lr-sized
    updates): every parameter left has a gradient that is not 0 in exact arithmetic."""
    cfg = tiny_config("batch", placement, depth=3, mix_p=0.34, final_norm=final_norm, embed_norm=True)
    grads = _float64_gradients(cfg, monkeypatch)
    largest = max(g.abs().max().item() for g in grads.values())
    assert {n for n, g in grads.items() if g.abs().max().item() < 1e-12 * largest} == set()
    if placement == "pre" and final_norm != False:  # noqa: E712
        assert "blocks.0.attn.proj.bias" not in grads and "blocks.0.attn.q_bias" in grads
        assert GPT(tiny_config("layer", placement)).blocks[0].attn.proj.bias is not None  # other norms keep them


def test_causal_batch_norm_before_every_reader_of_the_stream_cancels_the_position_embedding(monkeypatch):
    """The documented limit (docs/norms.md): per-position statistics subtract any per-position constant."""
    cfg = tiny_config("batch", "pre")
    cfg.norm.causal = True
    grads = _float64_gradients(cfg, monkeypatch)
    assert grads["pos_emb.weight"].abs().max().item() < 1e-12 * grads["tok_emb.weight"].abs().max().item()
