"""Packed arms (normlab.train.pack): every member's records equal its unpacked run's."""

import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import tiny_config
from normlab.config import ConfigError
from normlab.config.packing import pack_key
from normlab.train.pack import check_pack, train_pack
from normlab.nn.packed import PackedAdamW, PackedModel, clip_members
from normlab.nn.model import GPT
from normlab.train.run import train

TOLERANCE = 1e-5  # relative, the docs' bound for a member against its unpacked run (fp32, CPU)
# Telemetry of the weights after Adam's updates (update ratios, norm-parameter and attention statistics) is
# held to 1e-3: the gradients of some norm parameters are rounding noise (BatchNorm subtracts what they
# add), and Adam's first updates, g/(|g| + eps), turn that noise into weight changes of full size, so these
# figures follow the kernels' summation order. Measured on this CPU: an unpacked run on 2 threads instead of
# 1 moves update_ratio/L00/norms by 3.8e-4 and norm/gain_std by 1.1e-4 (BatchNorm, post, lr 1e-2).
WEIGHT_TOLERANCE = 1e-3
WEIGHT_STATS = ("update_ratio/", "norm/", "attn/")
# One token's (or one sequence's) max/median is not averaged over tokens, and dividing by a median of small
# magnitudes adds their rounding: held to 1e-4. Measured: 2.2e-5 apart (act/max_median_max/L00, BatchNorm post,
# lr 1e-2, step 5), where the mean over tokens, act/max_median, stays within 1e-5.
RATIO_TOLERANCE = 1e-4
RATIO_STATS = ("act/max_median_max/", "act/top_median/", "act/top_median_max/")
# A cosine, or an angle, carries the activations' rounding as an absolute error (about their relative error,
# in radians), which is a large relative one near 0: mean cosines between near-orthogonal tokens (1e-7 apart
# on -0.0026) and the angles of blocks near the identity (9e-6 degrees apart on 0.63, BatchNorm post). They
# are compared on the scale of a cosine's range (1) and of one radian (in degrees).
ABSOLUTE_SCALE = {"act/token_cos/": 1.0, "act/block_angle/": math.degrees(1.0),
                  "act/block_angle_last/": math.degrees(1.0)}


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def grid(norm, placement, lrs=(1e-3, 3e-3, 1e-2), seeds=(0, 1), **overrides):
    cfgs = []
    for lr in lrs:
        for seed in seeds:
            cfg = tiny_config(norm, placement, lr=lr, seed=seed, max_steps=6, sinks=["jsonl"], **overrides)
            cfgs.append(cfg)
    return cfgs


def worst_difference(expected, got, skip=("tokens_per_s",)):
    """The largest relative difference (on ABSOLUTE_SCALE for its keys) between two runs' metrics rows, as a
    multiple of each key's tolerance (TOLERANCE, or WEIGHT_TOLERANCE for WEIGHT_STATS), and where; the rows
    must match in steps and keys.
    Below 1: every value is within its tolerance."""
    assert [r["step"] for r in expected] == [r["step"] for r in got]
    worst, where = 0.0, None
    for a, b in zip(expected, got):
        assert set(a) == set(b), f"step {a['step']}: keys differ: {sorted(set(a) ^ set(b))}"
        for key, value in a.items():
            if key in skip or not isinstance(value, float):
                assert value == b[key] or key in skip, (a["step"], key)
                continue
            if math.isnan(value):
                assert math.isnan(b[key]), (a["step"], key)
                continue
            bound = (WEIGHT_TOLERANCE if key.startswith(WEIGHT_STATS)
                     else RATIO_TOLERANCE if key.startswith(RATIO_STATS) else TOLERANCE)
            scale = next((v for k, v in ABSOLUTE_SCALE.items() if key.startswith(k)), max(abs(value), 1e-12))
            diff = abs(value - b[key]) / scale / bound
            if diff > worst:
                worst, where = diff, (a["step"], key, value, b[key])
    return worst, where


def train_both(cfgs, tmp_path):
    for i, cfg in enumerate(cfgs):
        train(cfg, tmp_path / f"run{i}")
    summaries = train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    return summaries


# BatchNorm arms run the default config: the model builds no shift that a BatchNorm subtracts again (its
# gradient would be rounding noise, which Adam scales up to updates that follow the kernels' summation order).
# Post-BN without linear biases: its query biases are nearly cancelled (the next BatchNorm subtracts what
# passes through attention's values), with gradients ~1e-7 of the largest, and with them
# grad/norm/L00/norms agrees within 1.1e-5, not 1e-5 (lr 1e-2, step 2).
ARMS = [("layer", "pre", {}), ("layer", "post", {}), ("rms", "pre", {}), ("rms", "post", {}),
        ("batch", "pre", {}), ("batch", "post", {"bias": False}), ("batch", "sandwich", {}),
        ("derf", "pre", {})]  # scalar α and s: a member's parameters of shape (M,)


@pytest.mark.parametrize("norm,placement,model", ARMS, ids=[f"{n}-{p}" for n, p, _ in ARMS])
def test_each_member_of_a_pack_equals_its_unpacked_run(norm, placement, model, tmp_path, one_thread):
    # Two lrs (the grid's lowest and highest) × two seeds: every member differs from every other in lr or seed,
    # as with a third lr between them, at two thirds of the runs (each unpacked run costs about 0.5 s here).
    cfgs = grid(norm, placement, lrs=(1e-3, 1e-2))
    for cfg in cfgs:
        cfg.model = replace(cfg.model, **model)
        cfg.telemetry.every = 2
    summaries = train_both(cfgs, tmp_path)
    for i, cfg in enumerate(cfgs):
        worst, where = worst_difference(rows(tmp_path / f"run{i}"), rows(tmp_path / f"member{i}"))
        assert worst < 1, (cfg.run_name, where)
        alone = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        assert summaries[i]["status"] == alone["status"] == "completed"
        assert summaries[i]["name"] == alone["name"] == cfg.run_name
        assert summaries[i]["pack_size"] == len(cfgs)
        assert json.loads((tmp_path / f"member{i}" / "config.json").read_text()) == cfg.to_dict()


def test_a_member_of_the_new_arms_equals_its_unpacked_run(tmp_path, one_thread):
    """LayerNorm Scaling with an embedding norm, ReZero gates, QK-norm over the whole projection, capped
    attention logits and the z-loss, all at once: the member's rows (its z-loss term too) are its run's."""
    cfgs = grid("rms", "lns", lrs=(1e-3, 1e-2), seeds=(0,), embed_norm=True, residual_gate="rezero",
                residual_gate_init=0.1, qk_norm=True, qk_norm_axis="all", attn_softcap=5.0, z_loss=1e-3)
    for cfg in cfgs:
        cfg.telemetry.every = 2
    summaries = train_both(cfgs, tmp_path)
    for i, cfg in enumerate(cfgs):
        expected = rows(tmp_path / f"run{i}")
        worst, where = worst_difference(expected, rows(tmp_path / f"member{i}"))
        assert worst < 1, (cfg.run_name, where)
        assert all(r["z_loss"] > 0 for r in expected if "loss" in r)
        assert summaries[i]["name"] == cfg.run_name == f"rms-lns-qk_all-embnorm-rezero0.1-cap5-z1e-3-d2-lr{('1e-3', '1e-2')[i]}-s0"


def test_a_diverged_member_is_recorded_and_frozen_while_the_others_go_on(tmp_path, one_thread):
    cfgs = grid("layer", "pre", lrs=(1e-3, 1e3), seeds=(0,))
    for cfg in cfgs:
        cfg.max_steps, cfg.log_every, cfg.eval_every = 12, 3, 6
        cfg.telemetry.every = 0
    summaries = train_both(cfgs, tmp_path)
    alone = [json.loads((tmp_path / f"run{i}" / "summary.json").read_text()) for i in range(2)]
    assert alone[1]["status"] == summaries[1]["status"] == "diverged"
    assert summaries[1]["diverged_step"] == alone[1]["diverged_step"]
    assert summaries[1]["steps"] == alone[1]["steps"] and summaries[1]["tokens"] == alone[1]["tokens"]
    assert summaries[0]["status"] == "completed"
    for i in range(2):
        worst, where = worst_difference(rows(tmp_path / f"run{i}"), rows(tmp_path / f"member{i}"))
        assert worst < 1, where
    assert math.isfinite(summaries[0]["final_val_loss"])


def test_nan_in_one_member_never_reaches_another():
    cfg = tiny_config("batch", "pre")
    cfg.model = replace(cfg.model, vocab_size=256)
    torch.manual_seed(0)
    pack = PackedModel([GPT(cfg), GPT(cfg), GPT(cfg)])
    with torch.no_grad():
        pack.params["blocks.0.attn.qkv.weight"][1].fill_(math.nan)
    x = torch.randint(0, 256, (3, 4, 16))
    loss = pack.losses(_loss, x, x)
    loss.sum().backward()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    for name, p in pack.params.items():
        assert torch.isfinite(p.grad[[0, 2]]).all(), name
    for name, b in pack.buffers.items():
        assert torch.isfinite(b[[0, 2]].float()).all(), name
    norms = clip_members(list(pack.params.values()), 1.0)
    assert torch.isfinite(norms[[0, 2]]).all()


def test_attention_under_vmap_on_cuda_takes_the_math_kernel_alone():
    from normlab.nn.packed import attention_kernels

    cuda = torch.backends.cuda
    before = cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()
    with attention_kernels(torch.device("cuda")):
        assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == (False, False, True)
        assert not cuda.cudnn_sdp_enabled()
    with attention_kernels(torch.device("cpu")):
        assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == before
    assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == before


def test_the_math_attention_kernel_under_vmap_gives_each_members_loss_and_gradient(monkeypatch):
    """The path a pack without folded attention takes on CUDA (torch's math kernel, batched by vmap), run here
    on the CPU: each member's loss and gradients equal its model's alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import normlab.nn.packed as packed

    monkeypatch.setattr(packed, "attention_kernels", lambda device: sdpa_kernel([SDPBackend.MATH]))
    cfg = tiny_config("layer", "pre")
    cfg.model = replace(cfg.model, vocab_size=256)
    torch.manual_seed(0)
    members = [GPT(cfg), GPT(cfg)]
    pack = PackedModel(members, fold_attention=False)
    x, y = torch.randint(0, 256, (2, 3, 16)), torch.randint(0, 256, (2, 3, 16))
    losses = pack.losses(_loss, x, y)
    losses.sum().backward()
    for m, model in enumerate(members):
        alone = _loss(model(x[m]), y[m])
        alone.backward()
        torch.testing.assert_close(losses[m], alone, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(pack.params[name].grad[m], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kernels", ["folded", "default", "math"])
def test_a_batchnorm_pack_runs_under_bf16_autocast_as_its_members_alone(kernels, monkeypatch):
    """BatchNorm's shift-free attention adds its query bias in float32, which promotes q under autocast; an
    ordinary forward's autocast casts attention's inputs back, vmap's did not (a GPU's 72-run ablation failed
    every BatchNorm pack: "Expected query, key, and value to have the same dtype"). Each member's loss and
    gradients under bf16 autocast equal its model's alone: with folded attention (a pack's), and with attention
    under vmap on the default and the math kernel (CUDA's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import normlab.nn.packed as packed
    from normlab.train.loop import loss_fn  # in float32, as training's: vmap skips autocast's float32 casts

    if kernels == "math":
        monkeypatch.setattr(packed, "attention_kernels", lambda device: sdpa_kernel([SDPBackend.MATH]))
    cfg = tiny_config("batch", "pre")
    cfg.model = replace(cfg.model, vocab_size=256)
    torch.manual_seed(0)
    members = [GPT(cfg), GPT(cfg)]
    assert members[0].blocks[0].attn.q_bias is not None
    pack = PackedModel(members, fold_attention=kernels == "folded")
    x, y = torch.randint(0, 256, (2, 4, 16)), torch.randint(0, 256, (2, 4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = pack.losses(loss_fn, x, y)
    losses.sum().backward()
    for m, model in enumerate(members):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            alone = loss_fn(model(x[m]), y[m])
        alone.backward()
        torch.testing.assert_close(losses[m], alone, rtol=1e-2, atol=1e-3)
        for name, p in model.named_parameters():
            torch.testing.assert_close(pack.params[name].grad[m], p.grad, rtol=5e-2, atol=1e-3, msg=name)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def test_packed_adamw_takes_torch_adamw_steps_per_member_lr():
    torch.manual_seed(0)
    members = [torch.nn.Linear(4, 3) for _ in range(2)]
    pack = PackedModel(members)
    lrs = [1e-2, 3e-1]
    references = [torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) for m, lr in zip(members, lrs)]
    for group in (r.param_groups[0] for r in references):
        group["weight_decay"] = 0.1
    packed = PackedAdamW(pack.params, {"weight"}, (0.9, 0.95), 1e-8, 0.1)
    # torch's reference decays every parameter of its one group: decay the bias too, for the comparison
    packed.decay = {"weight", "bias"}
    for _ in range(3):
        grads = {n: torch.randn_like(p) for n, p in pack.params.items()}
        for i, m in enumerate(members):
            for n, p in m.named_parameters():
                p.grad = grads[n][i].clone()
            references[i].step()
        for n, p in pack.params.items():
            p.grad = grads[n].clone()
        packed.step(lrs)
    for i, m in enumerate(members):
        for n, p in m.named_parameters():
            torch.testing.assert_close(pack.params[n][i], p, rtol=0, atol=0)  # bit for bit


def test_clipping_is_per_member():
    torch.manual_seed(0)
    p = torch.zeros(2, 3, requires_grad=True)
    p.grad = torch.tensor([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0]])
    norms = clip_members([p], 1.0)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5]))
    torch.testing.assert_close(p.grad[0], torch.tensor([0.6, 0.8, 0.0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p.grad[1], torch.tensor([0.3, 0.4, 0.0]))  # under the limit: unchanged


def test_pack_key_ignores_lr_seed_and_bookkeeping_only():
    a = tiny_config("layer", "pre", lr=1e-3, seed=0)
    b = tiny_config("layer", "pre", lr=3e-2, seed=5, progress=True)
    b.wandb.tags = ["x"]
    assert pack_key(a) == pack_key(b)
    assert pack_key(a) != pack_key(tiny_config("rms", "pre"))
    assert pack_key(a) != pack_key(tiny_config("layer", "pre", depth=3))


@pytest.mark.parametrize("change,words", [
    (lambda c: setattr(c, "placement", "post"), "differ only in lr, seed"),
    (lambda c: setattr(c, "compile", True), "compile=true"),
    (lambda c: setattr(c, "precision", "fp16"), "precision=fp16"),
])
def test_packing_is_refused_where_it_cannot_be_exact(change, words):
    cfgs = grid("layer", "pre", lrs=(1e-3,), seeds=(0, 1))
    change(cfgs[-1])
    if words != "differ only in lr, seed":
        change(cfgs[0])
    with pytest.raises(ConfigError, match=words.replace("=", "=").split(",")[0]):
        check_pack(cfgs)


def test_packing_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun"):
        check_pack(grid("layer", "pre", lrs=(1e-3,), seeds=(0,)))


def test_batchnorm_members_keep_their_own_running_statistics():
    cfg = tiny_config("batch", "post")
    cfg.model = replace(cfg.model, vocab_size=256)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(GPT(cfg))
    pack = PackedModel([GPT(cfg), GPT(cfg)])
    for i, model in enumerate(models):
        pack.load_member_state_dict(i, model.state_dict())
    pack.set_per_step(True)
    x = torch.randint(0, 256, (2, 4, 16), generator=torch.Generator().manual_seed(0))
    pack.losses(_loss, x, x)
    pack.advance_running_statistics()
    for i, model in enumerate(models):
        model(x[i])  # per_step false: the forward is the step
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(pack.buffers[name][i], buffer, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(pack.buffers["blocks.0.norm1.running_mean"][0], pack.buffers["blocks.0.norm1.running_mean"][1])


def test_a_pack_resumed_from_its_checkpoints_continues_exactly(tmp_path, one_thread, monkeypatch):
    from normlab.train import preempt

    cfgs = grid("batch", "post", lrs=(1e-3, 3e-3), seeds=(0, 1))
    for cfg in cfgs:
        cfg.max_steps, cfg.ckpt.every, cfg.telemetry.every = 8, 3, 2
    whole = train_pack([(cfg, tmp_path / f"whole{i}") for i, cfg in enumerate(cfgs)])
    asked = iter(range(100))  # SIGTERM seen at the boundary after step 4 (the loop asks once per step)
    with monkeypatch.context() as patch:
        patch.setattr(preempt, "requested", lambda: 15 if next(asked) == 4 else None)
        with pytest.raises(preempt.Preempted):
            train_pack([(cfg, tmp_path / f"cut{i}") for i, cfg in enumerate(cfgs)])
    cut = [json.loads((tmp_path / f"cut{i}" / "summary.json").read_text()) for i in range(len(cfgs))]
    assert {s["status"] for s in cut} == {"preempted"} and {s["preempted_step"] for s in cut} == {5}
    resumed = train_pack([(cfg, tmp_path / f"cut{i}") for i, cfg in enumerate(cfgs)])
    for i in range(len(cfgs)):
        worst, where = worst_difference(rows(tmp_path / f"whole{i}"), rows(tmp_path / f"cut{i}"))
        assert worst == 0, where  # bit for bit
        assert resumed[i]["final_val_loss"] == whole[i]["final_val_loss"]
        assert resumed[i]["resumed_from_step"] == 5
        # the wall time of both processes, each member's segments apart (the first up to its checkpoint)
        segments = resumed[i]["segments"]
        assert [(seg["from_step"], seg["to_step"]) for seg in segments] == [(0, 5), (5, 8)]
        assert resumed[i]["wall_time_s"] == pytest.approx(sum(seg["wall_time_s"] for seg in segments), abs=0.002)


def test_a_members_checkpoint_resumes_unpacked(tmp_path, one_thread):
    cfgs = grid("layer", "pre", lrs=(1e-3, 3e-3), seeds=(0,))
    for cfg in cfgs:
        cfg.max_steps, cfg.ckpt.every, cfg.ckpt.keep = 6, 3, 2
    train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    alone = replace(cfgs[1], max_steps=6)
    train(alone, tmp_path / "alone")
    # The member's checkpoint of step 3 continues as an unpacked run, from a copy of its run dir cut back to step 3.
    import shutil

    shutil.copytree(tmp_path / "member1", tmp_path / "continued")
    (tmp_path / "continued" / "checkpoints" / "step-000006.pt").unlink()
    (tmp_path / "continued" / "summary.json").unlink()
    summary = train(cfgs[1], tmp_path / "continued")
    assert summary["resumed_from_step"] == 3
    worst, where = worst_difference(rows(tmp_path / "alone"), rows(tmp_path / "continued"))
    assert worst < 1, where


def test_each_member_has_its_own_wandb_run(tmp_path):
    cfgs = grid("layer", "pre", lrs=(1e-3, 3e-3), seeds=(0,))
    for cfg in cfgs:
        cfg.sinks, cfg.max_steps = ["jsonl", "wandb"], 2
        cfg.wandb.mode = "offline"
    train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    runs = [list((tmp_path / f"member{i}" / "wandb").glob("offline-run-*")) for i in range(2)]
    assert [len(r) for r in runs] == [1, 1]
    assert runs[0][0].name.split("-")[-1] != runs[1][0].name.split("-")[-1]  # two run ids
    checkpoints = [torch.load(next((tmp_path / f"member{i}" / "checkpoints").glob("*.pt")), weights_only=True) for i in range(2)]
    assert [c["wandb_run_id"] for c in checkpoints] == [r[0].name.split("-")[-1] for r in runs]  # a resume continues each


def test_a_packs_final_checkpoints_are_written_by_a_thread_and_land_before_the_members_summaries(tmp_path, monkeypatch):
    """The members' final checkpoints are taken as the last step ends and written by a thread while the members' ends
    run; each is on disk before its member's summary.json says it completed."""
    import threading
    import time

    import normlab.train.checkpoint.file as file

    cfgs = grid("layer", "pre", lrs=(1e-3, 3e-3), seeds=(0,))
    for cfg in cfgs:
        cfg.max_steps, cfg.ckpt.every = 4, 2
    real, writes = file.write_atomic, []

    def slow_write(path, payload):
        time.sleep(0.2)
        real(path, payload)
        writes.append((path.name, threading.current_thread().name.startswith("pack-checkpoints"),
                       (path.parents[1] / "summary.json").exists()))

    monkeypatch.setattr(file, "write_atomic", slow_write)
    summaries = train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    assert [s["status"] for s in summaries] == ["completed"] * 2
    # The periodic checkpoint of step 2 is written in the loop, between steps; the final one by the thread.
    assert writes == [("step-000002.pt", False, False)] * 2 + [("step-000004.pt", True, False)] * 2
    for i in range(2):
        final = torch.load(tmp_path / f"member{i}" / "checkpoints" / "step-000004.pt", weights_only=True)
        assert final["step"] == 4 and final["state"]["step"] == 4


def test_a_final_checkpoint_the_disk_refuses_fails_the_pack(tmp_path, monkeypatch):
    import errno

    import normlab.train.checkpoint.file as file

    cfgs = grid("layer", "pre", lrs=(1e-3, 3e-3), seeds=(0,))
    for cfg in cfgs:
        cfg.max_steps = 2

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file, "write_atomic", full)
    with pytest.raises(OSError, match="No space left"):
        train_pack([(cfg, tmp_path / f"member{i}") for i, cfg in enumerate(cfgs)])
    summaries = [json.loads((tmp_path / f"member{i}" / "summary.json").read_text()) for i in range(2)]
    assert [s["status"] for s in summaries] == ["failed"] * 2
    assert all("No space left" in s["error"] for s in summaries)
