"""What a run's numbers depend on besides its config: the software, the device, the CPU threads and the
number of processes. summary.json records it as `environment` from the run's start, failed runs included,
so two results that differ can be told apart by more than their configs.

The CPU thread count alone changes results: `norm=batch model=tiny max_steps=50` ends at 3.9503 with
OMP_NUM_THREADS=2 and at 3.9395 with 1, since the reductions are summed in another order.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import normlab
import normlab.train.distributed as distributed
from normlab.train.runtime import resolve_device

INSTALLED = ("site-packages", "dist-packages")


def run_environment(device_name: str) -> dict[str, Any]:
    """The environment of a run on device `device_name` (its config's `device`: auto, cpu or cuda), as this
    process trains it. Never raises: what cannot be found is null."""
    device = _device(device_name)
    on_cuda = device is not None and device.type == "cuda"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if on_cuda else None,
        "device": _device_label(device, device_name),
        "torch_threads": torch.get_num_threads(),
        "world_size": distributed.world_size(),
        "normlab": normlab.__version__,
        "git_commit": git_commit(Path(normlab.__file__).resolve().parent.parent),
    }


def _device(name: str) -> torch.device | None:
    try:
        return resolve_device(name)
    except Exception:  # device=cuda without one: the run fails on it, its summary still says what was asked
        return None


def _device_label(device: torch.device | None, asked: str) -> str:
    """'cpu', or the GPU's name ('NVIDIA H100 80GB HBM3'); what was asked for if it cannot be resolved."""
    if device is None:
        return asked
    if device.type != "cuda":
        return device.type
    try:
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.get_device_name(index)
    except Exception:
        return "cuda"


@functools.lru_cache(maxsize=4)
def git_commit(source_root: Path) -> str | None:
    """The HEAD commit of the git checkout holding normlab's source at `source_root`, when normlab runs from
    a source tree (an editable install, or PYTHONPATH); None for an installed copy, outside a checkout, or
    without git."""
    if any(part in INSTALLED for part in source_root.parts):
        return None  # an installed copy: a checkout around it (a project's venv) is not normlab's source
    try:
        result = subprocess.run(["git", "-C", str(source_root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and len(commit) >= 40 else None
