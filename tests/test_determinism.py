"""The determinism setting: a deterministic run turns torch's and Inductor's settings on, and the next plain run
turns them off (a sweep's jobs share a process)."""

import pytest
import torch

import normlab.train.runtime as runtime


@pytest.fixture
def determinism_restored():
    yield
    torch.use_deterministic_algorithms(False)


def test_a_deterministic_run_then_a_plain_one_turn_torchs_and_inductors_settings_on_and_off(determinism_restored):
    import torch._inductor.config as inductor

    runtime.configure_determinism(True)
    assert torch.are_deterministic_algorithms_enabled() and inductor.deterministic
    runtime.configure_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled() and not inductor.deterministic
