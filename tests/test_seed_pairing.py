"""What compare's paired intervals rely on: under one seed, arms that differ in norm, placement or lr see
the same training batches and start from the same initial weights; arms of another depth see the same
batches but other weights (docs/compare.md, How sure)."""

from dataclasses import replace

import torch

from normlab.config import RunConfig
from normlab.nn.model import GPT
from normlab.train.loop import batch_loader
from normlab.train.run import build_state
from normlab.train.runtime import seed_everything

TOKENS = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(3))
CPU = torch.device("cpu")


def config(norm="layer", placement="pre", lr=1e-3, seed=0, depth=2) -> RunConfig:
    cfg = RunConfig(placement=placement, lr=lr, seed=seed, depth=depth, batch_size=4, seq_len=16)
    return replace(cfg, norm=replace(cfg.norm, name=norm), model=replace(cfg.model, d_model=32, n_head=2, context=16))


def batches(cfg: RunConfig, n: int = 3) -> list[torch.Tensor]:
    seed_everything(cfg.seed)
    state = build_state(cfg, CPU, "fp32")
    next_batch = batch_loader(TOKENS, cfg, state.data_gen, CPU)
    return [next_batch()[0] for _ in range(n)]


def initial_weights(cfg: RunConfig) -> dict[str, torch.Tensor]:
    seed_everything(cfg.seed)
    return {name: p.detach() for name, p in GPT(cfg).named_parameters()}


def test_one_seed_gives_every_arm_the_same_batches_and_another_seed_others():
    first = batches(config())
    for other in (config(norm="rms", placement="post", lr=3e-3), config(norm="dyt", placement="sandwich"), config(depth=4)):
        assert all(torch.equal(a, b) for a, b in zip(first, batches(other)))
    assert not torch.equal(first[0], batches(config(seed=1))[0])


def test_one_seed_gives_arms_of_one_shape_the_same_initial_weights_but_not_another_depth():
    base = initial_weights(config())
    for other in (config(norm="rms", placement="post", lr=3e-3), config(norm="dyt", placement="sandwich")):
        weights = initial_weights(other)
        shared = [name for name in base if name in weights and "norm" not in name]
        assert "blocks.0.attn.qkv.weight" in shared and "tok_emb.weight" in shared
        assert all(torch.equal(base[name], weights[name]) for name in shared), other
    deeper = initial_weights(config(depth=4))
    assert not torch.equal(base["blocks.0.attn.qkv.weight"], deeper["blocks.0.attn.qkv.weight"])
    assert not torch.equal(base["blocks.0.attn.qkv.weight"], initial_weights(config(seed=1))["blocks.0.attn.qkv.weight"])
