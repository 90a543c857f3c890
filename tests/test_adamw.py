"""normlab's AdamW (normlab.train.adamw): torch's AdamW, bit for bit, that leaves torch._dynamo (and Inductor)
unimported where nothing compiles; and the determinism setting that skips a call that would change nothing."""

import importlib
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import normlab.train.adamw as adamw
import normlab.train.runtime as runtime
from normlab.train.adamw import AdamW
from normlab.train.optim import param_groups

# In a fresh interpreter: normlab's AdamW trains a small model three steps, is saved and restored, and the
# modules imported meanwhile are noted; then torch's AdamW (which imports torch._dynamo) does the same.
FRESH = """
import json, sys
import torch
from torch import nn
from normlab.train.adamw import AdamW
from normlab.train.optim import param_groups
from normlab.train.runtime import configure_determinism

def train(make):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 11))
    opt = make(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    x = torch.randint(0, 11, (4, 5))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
    again = make(param_groups(model, 0.1), lr=1e-2)
    again.load_state_dict(opt.state_dict())
    return [p.tolist() for p in model.parameters()], repr(again.state_dict())

configure_determinism(False)
ours = train(AdamW)
imported = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
theirs = train(torch.optim.AdamW)
print(json.dumps({"imported": imported, "same": ours == theirs,
                  "dynamo_after_torchs": "torch._dynamo" in sys.modules}))
"""


def test_in_a_fresh_process_it_trains_as_torchs_adamw_without_importing_dynamo_or_inductor():
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"imported": [], "same": True, "dynamo_after_torchs": True}


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _steps(make, n=3):
    model = _model()
    opt = make(param_groups(model, 0.1), lr=3e-3)
    x = torch.randn(5, 6)
    for _ in range(n):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def _graph_breaks(monkeypatch) -> list:
    import torch._dynamo

    breaks = []
    monkeypatch.setattr(torch._dynamo, "graph_break", lambda: breaks.append(1))
    return breaks


def test_with_dynamo_imported_the_step_is_torchs_with_its_graph_breaks(monkeypatch):
    breaks = _graph_breaks(monkeypatch)
    ours, _ = _steps(AdamW)
    assert len(breaks) == 6  # torch's wrapper: one before and one after each of the 3 updates
    theirs, _ = _steps(torch.optim.AdamW)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))


def test_without_dynamo_the_step_runs_the_update_alone_and_takes_the_same_values(monkeypatch):
    breaks = _graph_breaks(monkeypatch)
    theirs, _ = _steps(torch.optim.AdamW)
    breaks.clear()
    dynamo = sys.modules["torch._dynamo"]
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as in a process that never imported it
    ours, opt = _steps(AdamW)
    assert "torch._dynamo" not in sys.modules  # nothing imported it again: the update ran without torch's wrapper
    monkeypatch.setitem(sys.modules, "torch._dynamo", dynamo)
    assert breaks == []
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    assert all(not p.requires_grad or p.grad is not None for p in ours.parameters())
    assert opt.state_dict()["state"][0]["step"].item() == 3


def _differentiable_step_grads(make):
    """The gradients, with respect to the weights before one differentiable update, of a function of the weights
    after it."""
    draw = torch.Generator().manual_seed(2)  # not torch.manual_seed: torch._dynamo wraps it, imported on first call
    before = [torch.randn(3, 2, generator=draw).requires_grad_(), torch.randn(2, generator=draw).requires_grad_()]
    weights = [w.clone() for w in before]  # not leaves: the update is recorded on them
    for w in weights:
        w.grad = torch.randn(w.shape, generator=draw)
    make(weights, lr=0.1, weight_decay=0.1, differentiable=True).step()
    return torch.autograd.grad(sum(w.square().sum() for w in weights), before)


def test_without_dynamo_a_differentiable_step_is_recorded_by_autograd_as_torchs_is(monkeypatch):
    theirs = _differentiable_step_grads(torch.optim.AdamW)
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # as in a process that never imported it
    ours = _differentiable_step_grads(AdamW)
    assert "torch._dynamo" not in sys.modules  # the update ran without torch's wrapper, which imports it
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_step_hooks_run_once_a_step_even_where_torchs_adamw_was_hooked_first(monkeypatch):
    torch.optim.AdamW(_model().parameters())  # torch wraps AdamW.step in its profiling hook
    assert torch.optim.AdamW.step.hooked
    # as normlab.train.adamw finds torch's step where it is imported after that
    step, plain = adamw._unhooked_steps()
    assert step.__code__.co_name == "_use_grad" and plain.__qualname__ == "Adam.step"
    monkeypatch.setattr(adamw, "_STEP", step)
    monkeypatch.setattr(adamw, "_PLAIN_STEP", plain)
    seen = []
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-3)
    opt.register_step_pre_hook(lambda *_: seen.append("pre"))
    opt.register_step_post_hook(lambda *_: seen.append("post"))
    handle = importlib.import_module("torch.optim.optimizer").register_optimizer_step_pre_hook(lambda *_: seen.append("global"))
    try:
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
    finally:
        handle.remove()
    assert seen == ["global", "pre", "post"]


def test_a_wrapper_of_another_shape_is_left_to_torch(monkeypatch):
    def plain(*args):
        return args

    assert adamw._disabled_inners(plain) == []
    monkeypatch.setattr(adamw, "_INNER", None)  # a torch whose _disable_dynamo caches nothing on the function
    assert adamw._disabled_inners(torch.optim.Optimizer.zero_grad) == []


def test_the_optimizers_wrapped_calls_are_found():
    inners = adamw._disabled_inners(torch.optim.Optimizer.zero_grad)
    assert [inner.__code__.co_qualname for inner in inners] == ["_disable_dynamo.<locals>.inner"]
    adam = importlib.import_module("torch.optim.adam").adam
    assert len(adamw._disabled_inners(adam)) == 1  # held by _disable_dynamo_if_unsupported's closure
    assert adamw._STEP.__code__.co_name == "_use_grad" and adamw._PLAIN_STEP.__qualname__ == "Adam.step"


@pytest.fixture
def determinism_restored():
    yield
    torch.use_deterministic_algorithms(False)


def test_determinism_off_skips_only_a_call_that_would_change_nothing(monkeypatch, determinism_restored):
    import torch._inductor.config  # noqa: F401

    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC", raising=False)
    assert not runtime._determinism_off()  # Inductor's setting is imported: it is set
    monkeypatch.delitem(sys.modules, "torch._inductor.config")
    assert runtime._determinism_off()
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", "1")  # Inductor would import as deterministic
    assert not runtime._determinism_off()
    monkeypatch.delenv("TORCHINDUCTOR_DETERMINISTIC")
    torch.use_deterministic_algorithms(False, warn_only=True)
    assert not runtime._determinism_off()
    torch.use_deterministic_algorithms(True)
    assert not runtime._determinism_off()


def test_a_deterministic_run_then_a_plain_one_turn_torchs_and_inductors_settings_on_and_off(determinism_restored):
    import torch._inductor.config as inductor

    runtime.configure_determinism(True)
    assert torch.are_deterministic_algorithms_enabled() and inductor.deterministic
    runtime.configure_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled() and not inductor.deterministic


def test_a_wrapped_call_made_after_dynamo_is_imported_is_disabled_by_torchs_own_wrapper(monkeypatch):
    def update(x):
        return x + 1

    inner = torch._disable_dynamo(update)
    dynamo = sys.modules["torch._dynamo"]
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    adamw._run_directly_until_dynamo(inner)
    assert inner(1) == 2 and update.__dynamo_disable.__name__ == "until_dynamo"
    monkeypatch.setitem(sys.modules, "torch._dynamo", dynamo)
    disabled = []
    monkeypatch.setattr(dynamo, "disable", lambda fn, *args, **kwargs: disabled.append(fn) or fn)
    assert inner(2) == 3 and disabled == [update]  # torch's wrapper made the disabled form, and keeps it
    assert inner(3) == 4 and disabled == [update] and update.__dynamo_disable is update


def test_it_takes_torchs_arguments_positionally_too():
    model = _model()
    opt = AdamW(model.parameters(), 0.02, (0.8, 0.9))
    assert opt.defaults["lr"] == 0.02 and opt.defaults["betas"] == (0.8, 0.9)
