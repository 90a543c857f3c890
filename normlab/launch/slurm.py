"""normlab's side of `hydra/launcher=slurm` and `hydra/launcher=slurm_cpu` (hydra-submitit-launcher).

Two things that concern the person at the terminal, not the jobs:

- Before a sweep is submitted, `preflight` asks sbatch (`--test-only`) whether the cluster takes the
  launcher's settings. A refusal (GPUs asked of a partition that has none, an unknown partition, more
  memory than a node has...) stops the command with one `normlab: error:` line that gives SLURM's
  reason and the `hydra.launcher` key to change, before any job is queued, instead of the traceback
  submitit raises halfway through the submission.
- Where SLURM's accounting is disabled, submitit's sacct call fails on every poll and it logs
  "Bypassing sacct error" each time, and sacct prints its own error too: `quiet_sacct` stops both.

`check_sweep` does both for `normlab train -m hydra/launcher=slurm ...`.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict

# sbatch's reason (a fragment, lower case) → the launcher key that changes it, and the value to suggest.
# The first match counts ("Invalid account or account/partition combination" is about the account).
REFUSALS = (
    ("generic resource", "gpus_per_node", "0"),
    ("gres", "gpus_per_node", "0"),
    ("account", "account", "<yours>"),
    ("qos", "qos", "<allowed>"),
    ("partition", "partition", "{partitions}"),
    ("memory", "mem_gb", "<at most {memory_gb}>"),
    ("node configuration is not available", "cpus_per_task", "<at most {cpus}> or hydra.launcher.mem_gb=<at most {memory_gb}>"),
    ("time limit", "timeout_min", "<less>"),
)
CPU_HINT = " (e.g. hydra/launcher=slurm_cpu for a CPU partition)"


def refusal_reason(sbatch_stderr: str) -> str | None:
    """sbatch's reason from its stderr ("sbatch: error: Batch job submission failed: REASON"), or None
    when the text is not an sbatch error."""
    lines = [line for line in sbatch_stderr.splitlines() if "sbatch: error:" in line]
    if not lines:
        return None
    reason = lines[-1].split("sbatch: error:", 1)[1].strip()
    return reason.removeprefix("Batch job submission failed:").strip() or reason


def _sinfo(fields: str) -> list[str]:
    """sinfo's distinct answers for `fields` (empty when sinfo does not answer)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", fields], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(set(out.splitlines()))


def refusal_message(reason: str) -> str:
    """The one line for a refused submission: SLURM's reason, then which hydra.launcher key to set."""
    lowered = reason.lower()
    for needle, key, value in REFUSALS:
        if needle in lowered:
            break
    else:
        return f"SLURM refused the job: {reason}: change the hydra.launcher setting it names{CPU_HINT}"
    names = _sinfo("%R")
    # CPUs and MB of memory per node; sinfo marks a range of node sizes with "+" ("2+").
    sizes = [[int(n.rstrip("+")) for n in line.split()] for line in _sinfo("%c %m")]
    value = value.format(
        partitions=names[0] if len(names) == 1 else "<" + "|".join(names or ["name"]) + ">",
        cpus=max((c for c, _ in sizes), default="?"),
        memory_gb=max((m // 1024 for _, m in sizes), default="?"),
    )
    hint = CPU_HINT if key in ("gpus_per_node", "partition") else ""
    return f"SLURM refused the job: {reason}: set hydra.launcher.{key}={value}{hint}"


class _OnceSacctWarning(logging.Filter):
    """Lets submitit's first "Bypassing sacct error" through, reworded, and drops the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.shown = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Bypassing sacct error" not in record.getMessage():
            return True
        if self.shown:
            return False
        self.shown = True
        record.msg = f"{record.getMessage()} (further sacct errors are not shown)"
        record.args = ()
        return True


def accounting_disabled() -> bool:
    """True when the cluster keeps no job accounting (AccountingStorageType=accounting_storage/none)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.split("=")[-1].strip() == "accounting_storage/none" for line in out.splitlines() if "AccountingStorageType" in line)


def quiet_sacct() -> None:
    """Keep submitit's sacct failures off the terminal, in the launching process.

    Without accounting, every poll of submitit's job watcher runs sacct, which prints "Slurm
    accounting storage is disabled" to the terminal, and submitit warns each time. Then the watcher
    skips sacct altogether (submitit knows a job is done from its result file, as it does when sacct
    fails), and normlab says so once. Elsewhere a failing sacct's warning is shown once.
    """
    logger = logging.getLogger("submitit")
    if any(isinstance(f, _OnceSacctWarning) for f in logger.filters):
        return
    logger.addFilter(_OnceSacctWarning())
    if accounting_disabled():
        from submitit.slurm.slurm import SlurmJob  # submitit is optional (normlab[slurm]); SLURM sweeps have it

        SlurmJob.watcher._make_command = lambda: None  # the one watcher all of submitit's SLURM jobs share
        print("normlab: SLURM accounting is disabled: submitit follows the jobs through their result files", file=sys.stderr)


def sbatch_params(launcher: dict) -> tuple[dict, dict]:
    """The (executor init, update_parameters) arguments hydra-submitit-launcher makes of `launcher`, the
    composed hydra.launcher node, so the pre-flight asks sbatch for what the sweep would."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf  # optional (normlab[slurm])

    base = set(OmegaConf.structured(BaseQueueConf).keys())
    skip = {"_target_", "submitit_folder", "name", "max_num_timeout", "setup"}
    params = {k if k in base else f"slurm_{k}": v for k, v in launcher.items() if k not in skip}
    return {"slurm_max_num_timeout": launcher.get("max_num_timeout", 0)}, params


def preflight(launcher: dict) -> str | None:
    """None when sbatch would take a job with the launcher's settings (or cannot be asked: no sbatch,
    no submitit), else the one line saying why SLURM refuses it and what to set."""
    try:
        import submitit  # optional (normlab[slurm]); without it there is nothing to ask
    except ImportError:
        return None
    init, params = sbatch_params(launcher)
    with tempfile.TemporaryDirectory(prefix="normlab-preflight-") as folder:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm", **init)
        executor.update_parameters(**params)
        script = Path(folder) / "preflight.sh"
        # submitit's own sbatch script: the same #SBATCH lines the sweep's jobs get.
        script.write_text(executor._executor._make_submission_file_text("true", "preflight"))
        try:
            answer = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None  # no sbatch here: submitit reports that itself when it submits
    if answer.returncode == 0:
        return None
    reason = refusal_reason(answer.stderr) or answer.stderr.strip().splitlines()[-1]
    return refusal_message(reason)


def launcher_config(config_module: str, overrides: list[str], config_dirs: list[str]) -> dict | None:
    """The hydra.launcher node a multirun with `overrides` gets, resolved, when it is submitit's SLURM
    launcher; None for any other launcher, or when Hydra cannot compose it (Hydra then says why)."""
    # The launcher is one for the whole sweep: the swept keys do not change it, and compose refuses sweeps.
    parsed = OverridesParser.create().parse_overrides(overrides)
    overrides = [o.input_line for o in parsed if not o.is_sweep_override()]
    if config_dirs:
        overrides = [*overrides, "hydra.searchpath=[" + ",".join(f"file://{Path(d).absolute()}" for d in config_dirs) + "]"]
    try:
        with initialize_config_module(config_module, version_base="1.3"):
            cfg = compose("config", overrides, return_hydra_config=True)
            launcher = cfg.hydra.launcher
            if not str(launcher.get("_target_", "")).endswith(".SlurmLauncher"):
                return None
            # name and submitit_folder refer to the job's Hydra runtime, which a compose does not have.
            with open_dict(launcher):
                del launcher["name"], launcher["submitit_folder"]
            return OmegaConf.to_container(launcher, resolve=True)
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()


def check_sweep(config_module: str, overrides: list[str], config_dirs: list[str]) -> str | None:
    """For a sweep on submitit's SLURM launcher: SLURM's refusal of its settings as one line, else None
    (and submitit's repeated sacct warnings shown once)."""
    launcher = launcher_config(config_module, overrides, config_dirs)
    if launcher is None:
        return None
    refusal = preflight(launcher)
    if refusal is None:
        quiet_sacct()
    return refusal
