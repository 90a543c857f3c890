"""normlab's optimizer: torch.optim.AdamW, whose calls leave torch._dynamo unimported where nothing compiles.

torch wraps the optimizer's calls for torch.compile: the step in `_use_grad`, which imports torch._dynamo to
mark graph breaks around the update, and add_param_group (which the constructor calls), zero_grad, state_dict
and load_state_dict in `torch._disable_dynamo`, which imports it at their first call to exempt them from
tracing (the update function has a `torch._disable_dynamo` form too, but calls it only while compiling).
Outside torch.compile's tracing both do nothing, yet the import costs a second of one core: a fifth of a
one-step run on the CPU, and of a CPU sweep's forkserver start. Nothing can be traced before torch._dynamo is
imported, so until it is (a run with compile=true, or anything else importing it), these calls run the wrapped
function directly; from then on, torch's own wrappers. The update is the same either way (tests/test_adamw.py):
only what runs around it differs.

Where torch's wrappers are not shaped as in torch 2.13 (the version checked here; the GPU machine runs 2.11),
nothing is changed, and the import happens at the first call as before.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

import torch

DYNAMO = "torch._dynamo"


def _disable_dynamo_inner_code():
    """The code of the function torch._disable_dynamo wraps a function in, if it caches the disabled function
    on the wrapped one's `__dynamo_disable` as torch 2.13's does; else None."""
    wrapper = getattr(torch, "_disable_dynamo", None)
    if wrapper is None:
        return None
    code = getattr(wrapper(lambda: None), "__code__", None)
    if code is None or "__dynamo_disable" not in code.co_names or "fn" not in code.co_freevars:
        return None
    return code


_INNER = _disable_dynamo_inner_code()


def _disabled_inners(obj: Any, depth: int = 0) -> list[Callable]:
    """torch._disable_dynamo's wrappers in `obj`: itself, or a function its closure holds (as
    `_disable_dynamo_if_unsupported`'s `maybe_fallback` holds the update's)."""
    fn = getattr(obj, "__func__", obj)
    code = getattr(fn, "__code__", None)
    if code is None or _INNER is None:
        return []
    if code is _INNER:
        return [fn]
    found = []
    for cell in (getattr(fn, "__closure__", None) or ()) if depth == 0 else ():
        try:
            found += _disabled_inners(cell.cell_contents, depth + 1)
        except ValueError:  # an empty cell
            pass
    return found


def _run_directly_until_dynamo(inner: Callable) -> None:
    """Let `inner` (a torch._disable_dynamo wrapper) call its function directly while torch._dynamo is
    unimported; at its first call after, it makes the function's disabled form itself, as at a first call."""
    fn = inspect.getclosurevars(inner).nonlocals["fn"]
    if getattr(fn, "__dynamo_disable", None) is not None:
        return  # torch made (or we gave) it its disabled form already

    def until_dynamo(*args, **kwargs):
        if DYNAMO in sys.modules:
            fn.__dynamo_disable = None
            return inner(*args, **kwargs)
        return fn(*args, **kwargs)

    fn.__dynamo_disable = until_dynamo


def defer_dynamo_import() -> None:
    """The optimizer's torch._disable_dynamo-wrapped calls (AdamW's and Optimizer's methods, the update
    function) run directly until torch._dynamo is imported. Process-wide: Optimizer's methods are every torch
    optimizer's (SGD's too), and are traced the same either way."""
    import torch.optim.adam as adam
    import torch.optim.adamw as adamw

    owners = [vars(torch.optim.Optimizer), vars(torch.optim.Adam), vars(torch.optim.AdamW), vars(adam), vars(adamw)]
    for owner in owners:
        for value in list(owner.values()):
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                for inner in _disabled_inners(value):
                    _run_directly_until_dynamo(inner)


def _unhooked_steps() -> tuple[Callable, Optional[Callable]]:
    """AdamW's step as torch wraps it (`_use_grad`) without the profiling hook torch may have put around it
    (Optimizer._patch_step_function, whose hook normlab's AdamW gets of its own), and the update as written
    inside that wrapper: None where the wrapper is not shaped as in torch 2.13."""
    step = next(vars(k)["step"] for k in torch.optim.AdamW.__mro__ if "step" in vars(k))
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    plain = getattr(step, "__wrapped__", None)
    if getattr(getattr(step, "__code__", None), "co_name", None) != "_use_grad" or not callable(plain):
        plain = None
    return step, plain


_STEP, _PLAIN_STEP = _unhooked_steps()


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW; its calls import torch._dynamo only where it is imported already (see the module's
    docstring). Checkpoints hold the same state_dict."""

    def __init__(self, params, *args, **kwargs) -> None:
        defer_dynamo_import()
        super().__init__(params, *args, **kwargs)

    def step(self, closure=None):
        """torch.optim.AdamW.step. Torch's wrapper runs the update with gradients off (on for a differentiable
        optimizer) between two graph breaks, which only torch.compile's tracing sees; so while torch._dynamo is
        unimported, the update runs under the same grad mode without them."""
        if _PLAIN_STEP is None or DYNAMO in sys.modules:
            return _STEP(self, closure)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _PLAIN_STEP(self, closure)
