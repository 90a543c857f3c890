"""The block-influence, rank-collapse, outlier, entropy-collapse and log Z statistics: each reduction against a
computation by hand on a fixed tensor, the logged values against a forward done by hand, and the same keys
from a packed member and in wandb."""

import json
import math

import numpy as np
import pytest
import torch

import normlab.telemetry.stats as probe_stats
from conftest import tiny_config
from normlab.config import TelemetryConfig
from normlab.data import load_corpus, sample_batch
from normlab.nn.model import GPT
from normlab.telemetry.probe import PROBE_SEQS, Probe
from normlab.telemetry.stats import (
    attention_stats,
    feature_kurtosis,
    head_entropy_stats,
    logz_sum,
    max_median_ratios,
    token_angles,
    token_cos,
    top_median_ratios,
    units,
)
from normlab.train.run import train
from normlab.train.runtime import seed_everything
from test_pack import grid, rows, train_both, worst_difference
from test_telemetry import head_entropies_by_hand, run
from test_wandb import OfflineRun, no_user_wandb_settings  # noqa: F401  (a fixture, named in usefixtures)
from test_wandb import _cfg as wandb_cfg

NEW_STATS = ("act/block_angle", "act/block_angle_last", "act/token_cos", "act/kurtosis", "act/max_median",
             "act/max_median_max", "act/top_median", "act/top_median_max", "attn/entropy_min")


# ---------------------------------------------------------------- by hand, one value at a time


def angles_by_hand(x: np.ndarray, y: np.ndarray) -> list[float]:
    """The angle in degrees between x[t] and y[t] for every token t (last axis: features)."""
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    out = []
    for a, b in zip(x, y):
        cos = sum(p * q for p, q in zip(a, b)) / (math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in b)))
        out.append(math.degrees(math.acos(max(-1.0, min(1.0, cos)))))
    return out


def token_cos_by_hand(y: np.ndarray) -> list[float]:
    """For each sequence of y (B, T, d), the mean over ordered pairs i != j of cos(y_i, y_j)."""
    means = []
    for seq in y:
        cosines = [
            float(seq[i] @ seq[j] / (np.linalg.norm(seq[i]) * np.linalg.norm(seq[j])))
            for i in range(len(seq)) for j in range(len(seq)) if i != j
        ]
        means.append(sum(cosines) / len(cosines))
    return means


def kurtosis_by_hand(y: np.ndarray) -> float:
    """He et al. 2024: s_j = RMS over tokens of feature j; mean(s^4) / mean(s^2)^2."""
    flat = y.reshape(-1, y.shape[-1])
    rms = [math.sqrt(sum(v * v for v in flat[:, j]) / len(flat)) for j in range(flat.shape[1])]
    return (sum(s**4 for s in rms) / len(rms)) / (sum(s**2 for s in rms) / len(rms)) ** 2


def max_median_by_hand(y: np.ndarray) -> list[float]:
    """For each token, centred over its features (c_j = y_j − mean y): max |c_j| / the lower median of |c_j|,
    as He et al.'s code (bobby-he/simplified_transformers, train_utils.py) takes it."""
    out = []
    for token in y.reshape(-1, y.shape[-1]):
        mean = sum(float(v) for v in token) / len(token)
        magnitudes = sorted(abs(float(v) - mean) for v in token)
        out.append(magnitudes[-1] / magnitudes[(len(magnitudes) - 1) // 2])
    return out


def top_median_by_hand(y: np.ndarray) -> list[float]:
    """For each sequence of y (B, T, d): the largest |y| over its T·d values / their lower median (Sun et al. 2024)."""
    out = []
    for seq in y:
        magnitudes = sorted(abs(float(v)) for v in seq.reshape(-1))
        out.append(magnitudes[-1] / magnitudes[(len(magnitudes) - 1) // 2])
    return out


def logz_by_hand(logits: np.ndarray) -> list[float]:
    return [math.log(sum(math.exp(float(v)) for v in row)) for row in logits.reshape(-1, logits.shape[-1])]


def fixed(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def block_angle_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return token_angles(units(x), units(y)).sum()


def token_cos_sum(y: torch.Tensor) -> torch.Tensor:
    return token_cos(units(y)).sum()


def feature_square_sums(y: torch.Tensor) -> torch.Tensor:
    return y.square().reshape(-1, y.size(-1)).sum(0)


def max_median_sum(y: torch.Tensor) -> torch.Tensor:
    return max_median_ratios(y).sum()


def top_median_sum(y: torch.Tensor) -> torch.Tensor:
    return top_median_ratios(y).sum()


def test_block_angle_of_known_angles_and_of_a_fixed_tensor():
    theta = math.radians(30)
    x = torch.tensor([[[1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]])
    y = torch.tensor([[[math.cos(theta), math.sin(theta), 0.0], [6.0, 0.0, 0.0], [0.0, 0.0, 5.0], [-1.0, -1.0, 0.0]]])
    assert block_angle_sum(x, y).item() / 4 == pytest.approx((30 + 0 + 90 + 180) / 4, rel=1e-6)
    x, y = fixed(2, 5, 6), fixed(2, 5, 6, seed=1)
    want = angles_by_hand(x.numpy().astype(float), y.numpy().astype(float))
    assert block_angle_sum(x, y).item() == pytest.approx(sum(want), rel=1e-5)
    # Small angles, where arccos of a rounded float32 cosine would be off by ~0.02 degrees.
    near = x + 1e-4 * y
    small = angles_by_hand(x.double().numpy(), near.double().numpy())
    assert block_angle_sum(x, near).item() == pytest.approx(sum(small), rel=1e-3)


def test_token_cos_excludes_each_token_with_itself():
    y = fixed(3, 4, 5)
    assert token_cos_sum(y).item() / 3 == pytest.approx(np.mean(token_cos_by_hand(y.double().numpy())), abs=1e-6)
    same = torch.ones(2, 6, 4) * torch.tensor([1.0, -2.0, 0.5, 3.0])
    assert token_cos_sum(same).item() / 2 == pytest.approx(1.0, rel=1e-6)  # collapsed: every pair is parallel
    # Two opposite tokens: the one pair has cosine -1 (with i == j counted the mean would be 0).
    assert token_cos_sum(torch.tensor([[[1.0, 2.0], [-1.0, -2.0]]])).item() == pytest.approx(-1.0, rel=1e-6)


def test_kurtosis_is_he_et_al_s_over_the_features_rms():
    y = fixed(2, 7, 6)
    assert feature_kurtosis(feature_square_sums(y).tolist()) == pytest.approx(kurtosis_by_hand(y.double().numpy()), rel=1e-5)
    # Every feature of equal RMS gives 1; one feature of RMS 10 among 3 of RMS 1: (1e4 + 3)/4 / ((100 + 3)/4)^2.
    signs = torch.tensor([[1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 1.0, 1.0]])
    assert feature_kurtosis(feature_square_sums(signs).tolist()) == pytest.approx(1.0)
    outlier = signs * torch.tensor([10.0, 1.0, 1.0, 1.0])
    assert feature_kurtosis(feature_square_sums(outlier).tolist()) == pytest.approx((1e4 + 3) / 4 / (103 / 4) ** 2)


def test_he_et_al_s_code_logs_d_over_d_minus_1_times_the_centred_kurtosis_minus_1():
    """Their code centres each token over its features, divides by the stream's RMS and logs the unbiased variance
    over the features of the mean squares (the diagonal of the features' Gram matrix over tokens): written here
    from that description, it is d/(d - 1)·(K_c - 1), K_c act/kurtosis's K of the centred stream, which differs
    from K of the stream as it is when its tokens have a mean over their features."""
    d = 16
    y = fixed(3, 5, d).double() * torch.linspace(0.5, 3.0, d, dtype=torch.float64) + 0.7  # uneven features, offset
    centred = y - y.mean(-1, keepdim=True)
    flat = centred.reshape(-1, d) / centred.pow(2).mean().sqrt()
    logged = flat.pow(2).mean(0).var(correction=1).item()
    k_centred = feature_kurtosis(feature_square_sums(centred).tolist())
    assert logged == pytest.approx(d / (d - 1) * (k_centred - 1), rel=1e-5)
    assert abs(feature_kurtosis(feature_square_sums(y).tolist()) - k_centred) > 0.01  # act/kurtosis is not centred


@pytest.mark.parametrize("d", [1, 2, 7, 8, 33])
def test_lower_median_is_torchs_median_read_off_a_sort_or_a_selection(d):
    from normlab.telemetry.stats import selected_lower_median, sorted_lower_median

    torch.manual_seed(d)
    a = torch.randn(5, d).abs()
    a[0] = a[0, 0]  # a row of ties
    a[1, : d // 2] = 0.0  # a row half zeros
    for median in (sorted_lower_median, selected_lower_median):
        torch.testing.assert_close(median(a), a.median(-1).values, rtol=0, atol=0)


def test_max_abs_is_one_pass_max_and_min():
    from normlab.telemetry.stats import max_abs

    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, 6)
    x[1] = -x[1].abs() - 1  # a block whose largest magnitude is its most negative value
    x[2, 0, 0, 0] = math.nan
    got = max_abs(x, (1, 2, 3))
    want = x.abs().flatten(1).amax(-1)
    assert torch.equal(got[:2], want[:2]) and math.isnan(got[2]) and got.dtype == torch.float32
    assert max_abs(x[0], (0, 1, 2)).item() == x[0].abs().max().item()
    assert torch.equal(max_abs(x[:2], (3,)), x[:2].abs().amax(-1))
    with pytest.raises(ValueError, match="trailing"):
        max_abs(x, (1, 2))


def test_the_eager_telemetry_forward_binds_no_autograd_function_by_signature(monkeypatch):
    """torch binds the arguments of an autograd.Function with a setup_context by inspect.signature at every call
    (what vmap needs): the eager forward's collectors use the plain form, a pack's (under vmap) the other."""
    import inspect

    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, *args, **kwargs: calls.append(fn) or real(fn, *args, **kwargs))
    model = GPT(tiny_config("rms", "pre"))
    probe = Probe(model, every=1, max_steps=1)
    probe.forward(torch.randint(0, 256, (2, 16))).sum().backward()
    assert calls == [] and probe.collect()["grad/resid_rms/L01"] > 0


def test_max_median_per_token_centred_with_the_lower_median():
    # Means -1.5 and -0.5; |y - mean| sorted: 0.5, 2.5, 4.5, 6.5 and 1, 1, 1.5, 3.5.
    y = torch.tensor([[[1.0, -2.0, 3.0, -8.0], [0.5, 0.5, -4.0, 1.0]]])
    assert max_median_sum(y).item() == pytest.approx(6.5 / 2.5 + 3.5 / 1)
    y = fixed(2, 3, 7)
    assert max_median_sum(y).item() == pytest.approx(sum(max_median_by_hand(y.double().numpy())), rel=1e-5)


def test_max_median_ignores_an_offset_shared_by_a_tokens_features_and_stays_below_d_for_one_massive_feature():
    """Centring (He et al.'s code) takes out what all of a token's features share: an offset of 50 leaves each
    token's ratio as it was, where uncentred it would fall to about 1. One feature at M among d of size 1 moves
    the others by M/d, so the ratio tends to d - 1 as M grows (d = 64: 62.6 at M = 1e4), not to M."""
    y = fixed(4, 5, 64, seed=3)
    torch.testing.assert_close(max_median_ratios(y + 50.0), max_median_ratios(y), rtol=1e-4, atol=0)
    shifted = (y + 50.0).abs()
    assert (shifted.amax(-1) / shifted.median(-1).values).max() < 1.2 < max_median_ratios(y).min()  # uncentred
    token = torch.tensor([1.0, -1.0] * 32)
    token[0] = 1e4
    mean = (1e4 - 1) / 64
    assert max_median_ratios(token).item() == pytest.approx((1e4 - mean) / (1 + mean), rel=1e-6)
    assert 60 < max_median_ratios(token).item() < 63


def test_massive_activations_reach_sun_et_al_s_threshold_where_the_per_token_mean_cannot():
    """One massive token of 16: He et al.'s per-token ratio averaged over the tokens stays far below 1,000; its
    largest token and Sun et al.'s ratio (top |y| / median of the sequence) reach it. Every token's features
    have mean 0 here, so centring them changes nothing."""
    y = torch.tensor([2.0, -2.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64).repeat(1, 16, 1)  # max 2, median 1
    y[0, 3, :2] = torch.tensor([3000.0, -3000.0])  # the massive activation
    ratios = max_median_ratios(y).flatten()
    assert ratios.tolist() == [2.0] * 3 + [3000.0] + [2.0] * 12
    assert max_median_sum(y).item() / 16 == pytest.approx((15 * 2 + 3000) / 16)  # act/max_median: 189
    assert ratios.amax().item() == 3000.0  # act/max_median_max
    assert top_median_sum(y).item() == 3000.0  # act/top_median: the median of the 128 values is 1
    y = fixed(3, 5, 6)
    assert top_median_sum(y).item() == pytest.approx(sum(top_median_by_hand(y.double().numpy())), rel=1e-6)


def test_one_massive_sequence_among_eight_shows_in_the_largest_sequence_ratio():
    """Seven sequences at 3.6x and one at 1,000x (Sun et al.'s threshold): their mean (act/top_median) is 128,
    neither, while the largest (act/top_median_max) is the massive sequence's own ratio."""
    y = torch.ones(8, 4, 8, dtype=torch.float64)
    y[:, 0, 0] = 3.6
    y[5, 2, 3] = 1000.0
    ratios = top_median_ratios(y)
    assert ratios.tolist() == pytest.approx([3.6] * 5 + [1000.0] + [3.6] * 2, rel=1e-6)  # in float32
    assert top_median_sum(y).item() / 8 == pytest.approx((7 * 3.6 + 1000) / 8)  # act/top_median: 128.15
    assert ratios.amax().item() == 1000.0  # act/top_median_max


def test_attention_logits_are_float32_under_bf16_autocast():
    """Under a bf16 autocast (the model's forward) q.float() @ k.float() still ran in bf16: attn/logit_max and
    the entropies came from logits rounded to 8 bits. They are the float32 logits of the same q and k."""
    torch.manual_seed(0)
    q, k = (4 * torch.randn(2, 3, 2, 16, 32)).bfloat16(), (4 * torch.randn(2, 3, 2, 16, 32)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        largest, entropy = attention_stats(q, k)
    exact_largest, exact_entropy = attention_stats(q, k)  # no autocast: float32 throughout
    assert largest.dtype == torch.float32
    torch.testing.assert_close(largest, exact_largest, rtol=1e-6, atol=0)
    torch.testing.assert_close(entropy, exact_entropy, rtol=1e-5, atol=1e-6)


def test_entropy_min_is_the_smallest_head_mean():
    q, k = 3 * fixed(2, 3, 9, 4), 3 * fixed(2, 3, 9, 4, seed=1)
    q[:, 1] *= 4  # sharper attention in head 1: a lower entropy than the others
    _, head_sums = attention_stats(q, k)
    mean, smallest = head_entropy_stats(head_sums.tolist(), 2)
    by_hand = head_entropies_by_hand(q, k)
    assert min(by_hand) == by_hand[1]
    assert smallest == pytest.approx(by_hand[1], rel=1e-5) and mean == pytest.approx(np.mean(by_hand), rel=1e-5)


def test_attention_softcap_keeps_the_largest_logit_before_the_cap_and_the_entropy_after_it():
    """The largest logit is q·k/sqrt(head_dim) before the cap (the logit growth the cap hides); the entropy
    is that of the softmax over the capped logits."""
    q, k = 5 * fixed(1, 2, 6, 4), 5 * fixed(1, 2, 6, 4, seed=1)
    raw, _ = attention_stats(q, k)
    largest, head_sums = attention_stats(q, k, softcap=2.0)
    scores = (q.double() @ k.double().transpose(-2, -1)) / 2.0  # sqrt(head_dim) = 2
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert raw.item() == pytest.approx(scores[..., causal].max().item(), rel=1e-6)
    assert raw.item() > 4.0 and largest.item() == pytest.approx(raw.item(), rel=1e-6)
    scores = 2.0 * torch.tanh(scores / 2.0)
    entropies = []
    for t in range(6):
        p = torch.softmax(scores[0, 0, t, : t + 1], dim=0)
        entropies.append(-(p * p.log()).sum().item())
    assert head_sums[0].item() == pytest.approx(sum(entropies) / 6, rel=1e-5)


def test_logz_by_hand_and_in_chunks(monkeypatch):
    logits = 4 * fixed(2, 3, 11)
    want = sum(logz_by_hand(logits.double().numpy()))
    assert logz_sum(logits).item() == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(probe_stats, "LOGZ_CHUNK", 22)  # two rows per chunk
    assert logz_sum(logits).item() == pytest.approx(want, rel=1e-6)
    assert logz_sum(torch.zeros(1, 5, 8)).item() == pytest.approx(5 * math.log(8))  # uniform: log(vocab)


def test_attention_statistics_read_a_qk_norm_over_the_whole_projection_and_a_softcap():
    """A QK-norm over all heads at once (OLMo 2, qk_norm_axis=all) shows q and k after it in the heads' layout;
    an attention module with a `softcap` has its logits capped as the softmax sees them."""
    torch.manual_seed(0)
    model = GPT(tiny_config("rms", "pre", qk_norm=True, qk_norm_axis="all"))
    attn = model.blocks[0].attn
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    stats = {}
    for softcap in (None, 0.5):
        attn.softcap = softcap
        probe = Probe(model, every=1, max_steps=1)
        with torch.no_grad():
            probe.forward(x)
        stats[softcap] = probe.collect()
    with torch.no_grad():
        q, k, _ = attn.heads(model.blocks[0].norm1(model.tok_emb(x) + model.pos_emb(torch.arange(16))))
    assert stats[None]["attn/entropy_min/L00"] == pytest.approx(min(head_entropies_by_hand(q, k)), rel=1e-5)
    raw = stats[None]["attn/logit_max/L00"]  # the cap of 0.5 leaves the largest logit as it is
    assert raw > 0.5 and stats[0.5]["attn/logit_max/L00"] == pytest.approx(raw, rel=1e-6)
    assert stats[0.5]["attn/entropy/L00"] > stats[None]["attn/entropy/L00"]  # capped logits: a flatter softmax


def test_statistics_of_stacked_blocks_equal_each_blocks_own():
    """The Probe stacks the blocks' tensors: every reduction over a leading dimension equals its value per entry."""
    q, k, y = 3 * fixed(4, 2, 3, 9, 4), 3 * fixed(4, 2, 3, 9, 4, seed=1), fixed(4, 2, 5, 6, seed=2)
    largest, entropy = attention_stats(q, k, softcap=2.0)
    for i in range(4):
        alone = attention_stats(q[i], k[i], softcap=2.0)
        torch.testing.assert_close(largest[i], alone[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(entropy[i], alone[1], rtol=1e-6, atol=0)
        for stacked, one in ((token_angles(units(y[:-1]), units(y[1:]))[min(i, 2)], block_angle_sum(y[min(i, 2)], y[min(i, 2) + 1])),
                             (token_cos(units(y))[i].sum(), token_cos_sum(y[i])),
                             (max_median_ratios(y)[i].sum(), max_median_sum(y[i])),
                             (top_median_ratios(y)[i].sum(), top_median_sum(y[i]))):
            torch.testing.assert_close(stacked.sum(), one, rtol=1e-6, atol=1e-6)


def test_blocks_stacked_in_chunks_give_the_statistics_of_one_stack(monkeypatch):
    """Where a stack of every block would be too large (GPT-2 small at batch 32 x 1024), the Probe stacks a few
    blocks at a time: one block a chunk gives every statistic exactly as one chunk of all does."""
    import normlab.telemetry.sites as probe_sites

    torch.manual_seed(0)
    model = GPT(tiny_config("rms", "pre", depth=5, qk_norm=True))
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    stats = []
    for elements in (probe_sites.STACK_ELEMENTS, 1):
        monkeypatch.setattr(probe_sites, "STACK_ELEMENTS", elements)
        probe = Probe(model, every=1, max_steps=1)
        probe.forward(x).sum().backward()
        stats.append(probe.collect())
        model.zero_grad()
    assert len(stats[0]) > 100 and stats[0] == stats[1]


# ---------------------------------------------------------------- the logged values


def test_logged_values_equal_a_forward_by_hand(tmp_path, text_data):
    """Step 0 of a real run (batch 12: the probe's 8 sequences are a part of it) against the same
    forward done block by block, each statistic computed by hand."""
    cfg = tiny_config("rms", "pre", data=text_data, batch_size=12, max_steps=1, telemetry=TelemetryConfig(every=1))
    logged = run(cfg, tmp_path)[0]

    seed_everything(cfg.seed)
    model = GPT(cfg).train()
    x, _ = sample_batch(load_corpus(cfg.data).train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
    expected = {}
    with torch.no_grad():
        h = model.tok_emb(x) + model.pos_emb(torch.arange(cfg.seq_len))
        for i, block in enumerate(model.blocks):
            label = f"L{i:02d}"
            q, k, _ = block.attn.heads(block.norm1(h[:PROBE_SEQS]))  # pre-norm: attention reads norm1(x)
            out = block(h)
            before, after = h.double().numpy(), out.double().numpy()
            expected[f"act/block_angle/{label}"] = np.mean(angles_by_hand(before, after))
            expected[f"act/block_angle_last/{label}"] = np.mean(angles_by_hand(before[:, -1], after[:, -1]))
            expected[f"act/token_cos/{label}"] = np.mean(token_cos_by_hand(after))
            expected[f"act/kurtosis/{label}"] = kurtosis_by_hand(after)
            expected[f"act/max_median/{label}"] = np.mean(max_median_by_hand(after[:PROBE_SEQS]))
            expected[f"act/max_median_max/{label}"] = max(max_median_by_hand(after[:PROBE_SEQS]))
            expected[f"act/top_median/{label}"] = np.mean(top_median_by_hand(after[:PROBE_SEQS]))
            expected[f"act/top_median_max/{label}"] = max(top_median_by_hand(after[:PROBE_SEQS]))
            expected[f"attn/entropy_min/{label}"] = min(head_entropies_by_hand(q, k))
            h = out
        expected["out/logz"] = np.mean(logz_by_hand(model.head(model.norm_f(h)).double().numpy()))
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_packed_member_logs_its_unpacked_runs_new_keys(tmp_path, one_thread):
    """Micro-batches of 4 (batch 16, grad_accum 4): the probe's sequences span two micro-batches in both."""
    cfgs = grid("rms", "pre", lrs=(1e-3, 1e-2), seeds=(0,), batch_size=16, grad_accum=4)
    for cfg in cfgs:
        cfg.telemetry.every = 2
    train_both(cfgs, tmp_path)
    for i in range(len(cfgs)):
        expected, got = rows(tmp_path / f"run{i}"), rows(tmp_path / f"member{i}")
        logged = {key for row in got for key in row}
        assert {f"{stat}/L01" for stat in NEW_STATS} | {"out/logz"} <= logged
        worst, where = worst_difference(expected, got)  # every key, the new ones included
        assert worst < 1, where


@pytest.mark.usefixtures("no_user_wandb_settings")
def test_wandb_layers_true_gets_the_new_keys(tmp_path):
    train(wandb_cfg(layers=True), tmp_path)
    history = [row for row in OfflineRun(tmp_path).history if "act/block_angle/L00" in row]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    measured = [r for r in records if "act/block_angle/L00" in r]
    assert [row["step"] for row in history] == [r["step"] for r in measured] == [0, 3]
    for row, record in zip(history, measured):
        for key in [f"{stat}/L{i:02d}" for stat in NEW_STATS for i in range(2)] + ["out/logz"]:
            assert row[key] == pytest.approx(record[key], rel=1e-12), key



@pytest.mark.parametrize("elements", [1 << 22, 8192], ids=["one chunk", "chunks of blocks"])
def test_a_step_in_two_micro_batches_logs_what_one_batch_does(monkeypatch, elements):
    """grad_accum=2 on a batch of 16: the first micro-batch holds the 8 probed sequences, the second none. Each
    must cut its blocks into the same chunks (a review found the attention's chunks sized by the micro-batch's
    own probed rows: the second one's statistics then came in another order and were added to the wrong keys)."""
    import normlab.telemetry.sites as probe_sites

    monkeypatch.setattr(probe_sites, "STACK_ELEMENTS", elements)
    torch.manual_seed(0)
    model = GPT(tiny_config("rms", "pre", depth=4))
    x = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(0))
    stats = []
    for parts in (1, 2):
        probe = Probe(model, every=1, max_steps=1)
        for xm in x.chunk(parts):
            probe.forward(xm).sum().backward()  # a sum: the micro-batches' gradients add up to the batch's
        stats.append(probe.collect())
        model.zero_grad()
    assert stats[0].keys() == stats[1].keys()
    bad = {k: (stats[1][k], v) for k, v in stats[0].items() if not math.isclose(stats[1][k], v, rel_tol=1e-5, abs_tol=1e-6)}
    assert not bad, bad


def test_micro_batches_whose_statistics_come_in_different_orders_are_refused():
    from normlab.telemetry.sites import Entry

    probe = Probe(GPT(tiny_config("rms", "pre")), every=1, max_steps=1)
    one = ((Entry("rms", ("act/a",), 1, 4), Entry("rms", ("act/b",), 1, 4)), ())
    swapped = ((one[0][1], one[0][0]), ())
    probe._absorb(torch.zeros(2), torch.zeros(0), one)
    with pytest.raises(RuntimeError, match="measured their statistics in different orders"):
        probe._absorb(torch.zeros(2), torch.zeros(0), swapped)
