"""The learning-rate schedule's end convention, as lr_at's docstring and the README state it."""

import math

import pytest

from normlab.config import RunConfig
from normlab.train.optim import lr_at


@pytest.mark.parametrize("max_steps,warmup", [(500, 50), (50, 0), (100, 50)])
def test_the_floor_falls_on_step_max_steps_and_the_last_update_is_just_above_it(max_steps, warmup):
    cfg = RunConfig(max_steps=max_steps, lr=1e-3)
    cfg.optim.warmup_steps = warmup
    floor = cfg.lr * cfg.optim.min_lr_ratio
    assert lr_at(max_steps, cfg) == pytest.approx(floor, rel=1e-12)
    last = lr_at(max_steps - 1, cfg)
    assert last > floor
    assert last == pytest.approx(floor + (cfg.lr - floor) * (1 - math.cos(math.pi / (max_steps - warmup))) / 2, rel=1e-12)
    if warmup:
        assert lr_at(warmup - 1, cfg) == lr_at(warmup, cfg) == cfg.lr
