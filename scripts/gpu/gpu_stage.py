"""What every stage of scripts/gpu/acceptance.py shares: a stage and its figures, and the Context it runs in.

Each stage runs in a process of its own (acceptance.py starts it) and reports its figures one by one through
`Context.report`, which rewrites the stage's result file at once, so a stage cut off at its budget keeps the
figures it reached. On one CUDA GPU a stage measures at its full size; with `smoke` it runs the same code at a
tiny size on the CPU (bf16 where the CPU has native bf16, else fp32; no CUDA graphs).
"""

from __future__ import annotations

import functools
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # the benchmark scripts the stages run
SCRIPT = "python scripts/gpu/acceptance.py"
# Keys of metrics.jsonl rows and summary.json that are times, not results: they differ between any two runs.
TIMING = ("tokens_per_s", "train_time_s", "wall_time_s", "eval_time_s", "resumed_from_step", "phases")
# What --smoke changes in a `normlab train` command: a 2-block, 32-wide model, 4 × 16 tokens, a few steps, the CPU,
# no wandb (an offline wandb run costs a job a second or two, and the packed sweep has 21).
SMOKE_RUN = {"model": "tiny", "batch_size": "4", "seq_len": "16", "eval_batches": "1", "max_steps": "4",
             "device": "cpu", "wandb.mode": "disabled"}


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    target: str | None  # "<op> <number, true or false>" on one H100, e.g. ">= 1.0"; None: reported, no target


@dataclass(frozen=True)
class Stage:
    name: str
    figures: tuple[Figure, ...]
    budget_s: float  # wall-clock seconds on one H100 or H200 (STAGES says what they rest on)
    smoke_budget_s: float  # on the 2-core CPU, tiny sizes: a cap for a hang (a cold torch.compile takes minutes there under load)
    run: Callable[["Context"], None]
    what: str


class Context:
    """What a stage sees: smoke or not, its device and precision, a scratch dir, the directory of the run's JSON
    (`out`, for files kept beside it), its budget's end (`timeout`) and `report`."""

    def __init__(self, smoke: bool, result_path: Path, workdir: Path, out: Path | None = None,
                 budget_s: float | None = None):
        self.smoke, self.result_path, self.workdir = smoke, result_path, workdir
        self.out = workdir if out is None else out
        self.results: dict[str, dict[str, Any]] = {}
        self.deadline = None if budget_s is None else time.monotonic() + budget_s

    def timeout(self, reserve: float = 0.0) -> float | None:
        """Seconds a part of the stage may take while `reserve` seconds stay for the parts after it (at least 1);
        None where the stage has no budget (run on its own)."""
        return None if self.deadline is None else max(1.0, self.deadline - time.monotonic() - reserve)

    @functools.cached_property
    def device(self):
        """torch's device (torch is imported here, on first use: the stages that only start commands skip it)."""
        import torch

        if self.smoke:  # tiny steps gain nothing from a second thread, and on a shared CPU extra threads oversubscribe it
            torch.set_num_threads(1)
        return torch.device("cpu" if self.smoke else "cuda")

    @functools.cached_property
    def precision(self) -> str:
        return "bf16" if not self.smoke or cpu_has_bf16() else "fp32"

    def report(self, name: str, value: Any, detail: str, reference: str | None = None, command: str | None = None,
               ok: bool = True, control: float | None = None, timing: dict[str, Any] | None = None) -> None:
        """One figure measured; `ok=False` marks it missed whatever its value (e.g. its losses differ). A timed figure
        gives its `timing` (scripts/bench/windows.py: the clock, each variant's spread and raw per-window times), and
        an overhead figure its A/A `control`, in its own unit."""
        from normlab.util.files import write_json_atomic

        self.results[name] = {"value": value, "detail": detail, "reference": reference, "command": command, "ok": ok,
                              "control": control, "timing": timing}
        write_json_atomic(self.result_path, self.results)
        print(f"gpu_acceptance: {name} = {value}  ({detail})", flush=True)

    def run_overrides(self, keys: dict[str, Any], smoke: dict[str, Any] | None = None) -> list[str]:
        """`normlab train` overrides: `keys` on a GPU; with smoke, SMOKE_RUN's tiny size on the CPU in place of
        `keys`' size, then `smoke`'s keys."""
        if self.smoke:
            keys = {**SMOKE_RUN, **{k: v for k, v in keys.items() if k not in SMOKE_RUN}, **(smoke or {})}
        return [f"{k}={v}" for k, v in keys.items()]


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 arithmetic (oneDNN's check: AVX-512 BF16 or AMX)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def normlab_env(ctx: Context) -> dict[str, str]:
    from startup import script_env

    return {**script_env(), "OMP_NUM_THREADS": "1"} if ctx.smoke else script_env()  # one thread: bit-exact CPU reductions


def device_slug(device: str) -> str:
    """A file name's part for a device: h100 for 'NVIDIA H100 80GB HBM3', else the name in lower case and dashes."""
    known = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device)
    return known.group(1).lower() if known else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
