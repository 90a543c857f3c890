"""What this machine can give a run, checked before Hydra starts: the device, the memory, the run dir.

Each check raises ConfigError with one line. The memory check compares a rough estimate of what a
run needs (`estimate_memory`) with what the machine has: physical RAM on the CPU, free memory on a
CUDA device. The estimate errs low, so it refuses only runs that cannot fit, such as depth=1000000,
which would otherwise allocate for a minute and end in a MemoryError.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from normlab.config import BYTE_VOCAB, ConfigError, RunConfig
from normlab.launch.resolvers import task_dict
from normlab.train.sinks.rundir import check_output_dir

GIB = 2**30
PERSISTENT_BYTES_PER_PARAM = 16  # fp32 weight, its gradient, and AdamW's two moments
# Activations kept for the backward pass, per token and per layer, in units of d_model: the block's
# input, the two norms' outputs, q, k, v, the attention output and projection (8), and the MLP's
# hidden layer before and after GELU (2 × mlp_ratio). Attention scores are left out (SDPA need not keep them).
ACTIVATIONS_PER_TOKEN_LAYER = 8


@dataclass(frozen=True)
class MemoryEstimate:
    """A rough lower bound on a run's memory, in bytes."""

    params: int  # parameter count
    persistent: int  # parameters, gradients and AdamW state
    activations: int  # one micro-batch's activations and logits, kept for the backward pass

    @property
    def total(self) -> int:
        return self.persistent + self.activations


def estimate_memory(cfg: RunConfig, element_bytes: int = 4) -> MemoryEstimate:
    """What `cfg` needs at least: P = (V + C)·d + L·(4 + 2r)·d² parameters (embeddings, attention and MLP
    weights; biases and norm gains left out), 16 bytes each with gradient and AdamW state, plus
    b·T·(L·(8 + 2r)·d + 2V) activations of `element_bytes` for a micro-batch of b sequences of T tokens."""
    m = cfg.model
    vocab = m.vocab_size or {"byte": BYTE_VOCAB, "bpe": cfg.tokenizer.vocab_size}.get(cfg.tokenizer.kind, BYTE_VOCAB)
    d, depth, ratio = m.d_model, cfg.depth, m.mlp_ratio
    params = (vocab + m.context) * d + depth * (4 + 2 * ratio) * d * d
    tokens = cfg.micro_batch_size * cfg.seq_len
    activations = tokens * (depth * (ACTIVATIONS_PER_TOKEN_LAYER + 2 * ratio) * d + 2 * vocab) * element_bytes
    return MemoryEstimate(params, params * PERSISTENT_BYTES_PER_PARAM, activations)


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def physical_memory() -> int | None:
    """The machine's physical RAM in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfgs: list[RunConfig], device: str, units: list[list[int]] | None = None) -> None:
    """ConfigError if a run's estimated memory exceeds what `device` ('cpu' or 'cuda') has. `units`: the
    runs that train together in one process, as positions in `cfgs` (a pack's members: their estimates
    add up); None when each run trains alone."""
    if device == "cuda":
        import torch  # seconds to import: only for the device check, not for `normlab train --help`

        available, where = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))[0], "free on the CUDA device"
    else:
        available, where = physical_memory(), "of physical memory on this machine"
    if not available:
        return
    needs = [estimate_memory(cfg, element_bytes=2 if device == "cuda" and cfg.precision != "fp32" else 4) for cfg in cfgs]
    for cfg, need in zip(cfgs, needs):
        if need.total > available:
            raise ConfigError(
                f"{cfg.run_name} needs about {_gib(need.total)} ({need.params:,} parameters with gradients and AdamW "
                f"state: {_gib(need.persistent)}; activations: {_gib(need.activations)}), but there is {_gib(available)} "
                f"{where}: lower depth, model.d_model, batch_size or seq_len (or raise grad_accum)"
            )
    for unit in units or []:
        total = sum(needs[i].total for i in unit)
        if len(unit) > 1 and total > available:
            names = ", ".join(cfgs[i].run_name for i in unit[:3]) + (", ..." if len(unit) > 3 else "")
            raise ConfigError(
                f"pack=true: the pack of {len(unit)} runs ({names}) needs about {_gib(total)}, {_gib(needs[unit[0]].total)} "
                f"each, but there is {_gib(available)} {where}: sweep fewer lr and seed values in one command, or "
                "pack=false to train them one at a time"
            )


def check_machine(composed: list, multirun: bool, local: bool, units_of=None) -> None:
    """Check the composed jobs (Hydra configs, hydra node included) against this machine: the run dir
    (the sweep dir in a multirun) can be made; and when the jobs run here (`local`, not on a cluster
    through a launcher), the device exists (a sweep's job on a missing device fails alone, when it runs)
    and each run's memory estimate fits, a pack's members' together. `units_of(cfgs)`: the runs of `cfgs`
    (RunConfigs) that train together, as lists of positions (normlab.config.packing.pack_groups); None: each alone."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        out_dir = str(OmegaConf.select(composed[0], key)) if composed else None
    except Exception:  # an interpolation only a running Hydra resolves (${hydra:...}): Hydra makes the dir
        out_dir = None
    if out_dir is not None:
        check_output_dir(out_dir, key)
    if not local:
        return
    cfgs = [RunConfig.from_dict(task_dict(cfg), validate=False) for cfg in composed]
    for device in sorted({cfg.device for cfg in cfgs}):
        if multirun and device == "cuda" and not _has_cuda():
            continue  # in a sweep, that job fails alone and the sweep goes on, as any failing job does
        resolved = _checked_device(device)
        here = [cfg for cfg in cfgs if cfg.device == device]
        check_memory(here, resolved, units_of(here) if units_of and multirun else None)


# The device files through which a process reaches a GPU that torch.cuda can use on Linux: NVIDIA's driver, WSL's
# GPU paravirtualisation, AMD's ROCm (torch's HIP builds answer as torch.cuda), a Jetson's integrated GPU (nvgpu's
# control file, by its older and its newer name).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu")
# NVIDIA's device files exist once something makes them: udev, or else the nvidia-modprobe that the driver's libraries
# run at their first use (torch's look included). Before that, the GPU shows on the PCI bus, as sysfs lists it.
PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA_PCI_VENDOR = "0x10de"


def _nvidia_gpu_on_pci() -> bool:
    """Whether an NVIDIA GPU (a display or 3D controller: PCI class 0x03) may be on this machine's PCI bus: True
    where sysfs cannot be read."""
    try:
        names = os.listdir(PCI_DEVICES)
    except OSError:
        return True
    for name in names:
        try:
            vendor, pci_class = (Path(PCI_DEVICES, name, key).read_text().strip() for key in ("vendor", "class"))
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and pci_class.startswith("0x03"):
            return True
    return False


def gpu_impossible() -> bool:
    """True where torch can see no CUDA device, known without importing torch (a second, which a sweep's launching
    process would spend before its first job): Linux with none of GPU_DEVICE_FILES and no NVIDIA GPU on its PCI bus,
    or macOS, whose torch has no CUDA. False (ask torch) anywhere else, and wherever torch is imported already."""
    if "torch" in sys.modules:
        return False
    if sys.platform == "darwin":
        return True
    return (sys.platform.startswith("linux") and not any(os.path.exists(path) for path in GPU_DEVICE_FILES)
            and not _nvidia_gpu_on_pci())


def cpu_for_sure(device: str) -> bool:
    """Whether a run with this `device` setting computes on the CPU, known without torch: device=cpu, or auto where
    no GPU can be (gpu_impossible). False where torch must say."""
    return device == "cpu" or (device == "auto" and gpu_impossible())


def _checked_device(device: str) -> str:
    """check_device's answer ('cpu' or 'cuda'); without torch where the answer is the CPU anyway."""
    if cpu_for_sure(device):
        return "cpu"
    from normlab.train.runtime import check_device  # torch: seconds to import, not for `normlab train --help`

    return check_device(device)


def _has_cuda() -> bool:
    import torch  # seconds to import: only for the device check, not for `normlab train --help`

    return torch.cuda.is_available()


def visible_gpus(devices: Optional[Sequence[Any]] = None) -> list[str]:
    """The GPUs a sweep may use, as CUDA_VISIBLE_DEVICES entries: `devices` when given, else the
    entries of CUDA_VISIBLE_DEVICES when it is set, else every GPU torch sees ([] without CUDA)."""
    if devices is not None:
        return [str(d) for d in devices]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        entries = [e.strip() for e in env.split(",") if e.strip()]
        return [] if entries[:1] == ["-1"] else entries
    if gpu_impossible():
        return []
    import torch  # seconds to import: only to count the GPUs (Hydra's plugin scan imports the launcher)

    return [str(i) for i in range(torch.cuda.device_count())]


def check_launcher(settings) -> None:
    """ConfigError (one line naming the key and what it takes) unless normlab's launcher can run a sweep with
    `settings` (the composed hydra.launcher node) on this machine: jobs_per_gpu and cpu_jobs integers >= 1, mps auto,
    true or false, devices null or a list of GPU ids, and GPUs to put them on."""
    settings = OmegaConf.to_container(settings, resolve=True) if OmegaConf.is_config(settings) else dict(settings)
    for key in ("jobs_per_gpu", "cpu_jobs"):
        value = settings.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"hydra.launcher.{key}={_shown(value)}: must be an integer >= 1 (jobs at once on "
                              f"{'each GPU' if key == 'jobs_per_gpu' else 'the CPU, without a GPU'})")
    mps = settings.get("mps")
    if not (isinstance(mps, bool) or str(mps).lower() in ("auto", "true", "false")) or mps is None:
        raise ConfigError(f"hydra.launcher.mps={_shown(mps)}: must be auto, true or false")
    devices = settings.get("devices")
    if devices is None:
        return
    shown = f"hydra.launcher.devices={_shown(devices)}"
    if not isinstance(devices, list) or not all(
            (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (isinstance(d, str) and d.strip()) for d in devices):
        raise ConfigError(f"{shown}: must be null (every visible GPU) or a list of GPU ids, such as [0,1]")
    count = _gpu_count() if devices else 0
    if devices and not count:
        raise ConfigError(f"{shown}: this machine has no GPU torch can use: drop it (without a GPU the jobs run "
                          "on the CPU; hydra.launcher.cpu_jobs=N runs N at once)")
    beyond = [d for d in devices if isinstance(d, int) and d >= count]
    if beyond and os.environ.get("CUDA_VISIBLE_DEVICES") is None:  # else the ids may name GPUs it hides
        raise ConfigError(f"{shown}: this machine has {count} GPU{'s' if count > 1 else ''} (ids 0 to {count - 1}), "
                          f"no GPU {beyond[0]}: choose among them, or drop it for all of them")


def _gpu_count() -> int:
    """The CUDA devices torch sees here (0 where none can be, known without torch)."""
    if gpu_impossible():
        return 0
    import torch  # seconds to import: only for a sweep that names its GPUs

    return torch.cuda.device_count()


def _shown(value: Any) -> str:
    """`value` as an override writes it: [0,1], null, abc."""
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
