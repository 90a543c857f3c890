"""What a sweep found: one line per job as it ends, and a table of all jobs when the sweep ends.

`SweepReport` is a Hydra callback (conf/hydra/callbacks/sweep_report.yaml), so it works under every
launcher: the basic one, normlab's concurrent one, joblib's, submitit's. It reads each job's
summary.json (what train() writes at the end of a run), never the training loop's internals, and
writes the same text to the terminal and to `<sweep dir>/sweep.log`. As a grid sweep starts, it adds its command
to the sweep's record (normlab.launch.sweep_record).

Imports stay light (no torch): Hydra instantiates the callback before any job runs.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode

from normlab.launch import job_outcome
from normlab.launch.sweep_index import BASIC_SWEEPER
from normlab.launch.sweep_record import record_command

LOG_NAME = "sweep.log"


def read_summary(run_dir: Path) -> dict | None:
    """The run's summary.json, or None when the job ended before train() wrote one."""
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _loss(summary: dict | None) -> float:
    value = (summary or {}).get("final_val_loss")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else math.nan


def _status(summary: dict | None, fallback: str) -> str:
    return (summary or {}).get("status") or fallback


def _job_num(run_dir: Path) -> str:
    """A sweep job's number: the prefix of its dir name (hydra.sweep.subdir is `<num>_<run name>`)."""
    head = run_dir.name.split("_", 1)[0]
    return head if head.isdigit() else "?"


def job_line(run_dir: Path, fallback_status: str = "failed", noted: str | None = None) -> str:
    """One line for a job that ended: number, run name, status, final validation loss, the run's whole wall
    time (summary.json's wall_time_s: data, tokenizer and model set-up, the training loop and the records at
    the end; the run's own last line counts the training loop alone), run dir.

    `fallback_status` is the status when the job wrote no summary.json; `noted`, the status the job's process
    noted because its dir cannot tell it (job_outcome: the dir went, or another process holds it), wins over both,
    and then the dir's summary.json, if any, is not the job's."""
    run_dir = Path(run_dir)
    summary = read_summary(run_dir) if noted is None else {"name": _run_name(run_dir), "status": noted}
    name = (summary or {}).get("name") or run_dir.name
    loss = _loss(summary)
    wall = (summary or {}).get("wall_time_s")
    wall_text = f"{wall:.1f} s" if isinstance(wall, (int, float)) and not isinstance(wall, bool) else "-"
    loss_text = f"{loss:.4f}" if math.isfinite(loss) else "-"
    return (f"job {_job_num(run_dir)} {name}: {_status(summary, fallback_status)}, "
            f"final val loss {loss_text}, run wall time {wall_text} (set-up included), {_shown(run_dir)}")


def _run_name(run_dir: Path) -> str:
    """The run name in a job dir's name `<num>_<run name>`, else the dir's name."""
    head, _, rest = run_dir.name.partition("_")
    return rest if head.isdigit() and rest else run_dir.name


# job_line's text, read back for the jobs whose dir went (their line is all that is left of them).
JOB_LINE = re.compile(r"job (?P<num>\S+) (?P<name>.+?): (?P<status>.+), final val loss (?P<loss>\S+), "
                      r"run wall time (?P<wall>.+?) \(set-up included\), (?P<dir>.+)")


def _shown(path: Path) -> str:
    """`path` relative to the working dir when it lies below it (Hydra's job dirs are absolute)."""
    try:
        return str(Path(path).resolve().relative_to(Path(os.getcwd()).resolve()))
    except ValueError:
        return str(path)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job dirs: its subdirs that hold a summary.json or a .hydra dir (a job that ended early)."""
    return sorted(
        (d for d in Path(sweep_dir).iterdir() if d.is_dir() and ((d / "summary.json").exists() or (d / ".hydra").is_dir())),
        key=lambda d: (int(_job_num(d)) if _job_num(d).isdigit() else math.inf, d.name),
    )


def sweep_table(sweep_dir: Path, log_start: int | None = None) -> str:
    """Every job of the sweep, best final validation loss first (diverged, failed, busy and unfinished jobs last,
    their status in capitals; "run wall s" is summary.json's wall_time_s, as in job_line), then the sweep dir
    and the `normlab compare` command to run next. A dir another process holds is busy; with `log_start` (the
    size of sweep.log when the sweep began), a job whose dir went is listed from its line in sweep.log."""
    rows, summaries = [], []
    for d in job_dirs(sweep_dir):
        summary = read_summary(d)
        summaries.append(summary)
        status = _status(summary, "failed")
        if status in ("failed", "running"):
            status = job_outcome.busy(d) or status
        rows.append(_row(_job_num(d), (summary or {}).get("name") or d.name, status, _loss(summary),
                         (summary or {}).get("wall_time_s"), d.name))
    if log_start is not None:
        rows += [_row(m["num"], m["name"], m["status"], math.nan, None, Path(m["dir"]).name)
                 for m in _gone_jobs(Path(sweep_dir), log_start)]
    rows.sort(key=lambda r: (r[0], r[1], int(r[2]) if r[2].isdigit() else math.inf))
    phases = phase_totals(summaries)
    header = ("job", "run", "status", "final val loss", "run wall s", "dir")
    cells = [header, *(r[2:] for r in rows)]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(header))]
    lines = ["  ".join(str(c[i]).ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells]
    counts = {}
    for r in rows:
        word = r[4].split(":")[0].lower()
        counts[word] = counts.get(word, 0) + 1
    tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return "\n".join([
        f"sweep: {len(rows)} jobs ({tally}), best first",
        *lines,
        *([phases] if phases else []),
        f"sweep dir: {sweep_dir}",
        f"next: normlab compare {sweep_dir}",
    ])


def phase_totals(summaries: list) -> str:
    """'time by phase, summed over the jobs: train 31.2 s (46%), startup 12.0 s (18%), ...', largest first, from
    the summaries' `phases` (a pack's, shared by its members, counted once); '' when none has them."""
    totals: dict[str, float] = {}
    for summary in summaries:
        phases = (summary or {}).get("phases")
        if not isinstance(phases, dict):
            continue
        share = (summary or {}).get("phases_shared_by") or 1
        for name, seconds in phases.items():
            if isinstance(seconds, (int, float)) and isinstance(share, int) and share > 0:
                totals[name] = totals.get(name, 0.0) + seconds / share
    whole = sum(totals.values())
    if not totals or whole <= 0:
        return ""
    parts = [f"{name} {seconds:.1f} s ({100 * seconds / whole:.0f}%)"
             for name, seconds in sorted(totals.items(), key=lambda item: -item[1])]
    return "time by phase, summed over the jobs: " + ", ".join(parts)


def _row(num: str, name: str, status: str, loss: float, wall, dir_name: str) -> tuple:
    """A table row: sort keys, then the cells (a status other than completed in capitals, its reason as it is)."""
    word, colon, reason = status.partition(":")
    return (math.isnan(loss), loss, num, name, status if status == "completed" else word.upper() + colon + reason,
            f"{loss:.4f}" if math.isfinite(loss) else "-",
            f"{wall:.1f}" if isinstance(wall, (int, float)) and not isinstance(wall, bool) else "-", dir_name)


def _gone_jobs(sweep_dir: Path, log_start: int) -> list[re.Match]:
    """The lines sweep.log gained from byte `log_start` on for jobs whose dir no longer exists, the last per dir."""
    try:
        with open(sweep_dir / LOG_NAME, "rb") as log:
            log.seek(log_start)
            text = log.read().decode(errors="replace")
    except OSError:
        return []
    gone: dict[str, re.Match] = {}
    for line in text.splitlines():
        match = JOB_LINE.fullmatch(line)
        if match and not Path(match["dir"]).exists():
            gone[match["dir"]] = match
    return list(gone.values())


def report(text: str, sweep_dir: Path) -> None:
    """Print `text` and append it to the sweep's log file (one write, so concurrent jobs' lines stay whole)."""
    print(text, flush=True)
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / LOG_NAME, "a") as log:
        log.write(text + "\n")


class SweepReport(Callback):
    """Hydra callback: in a multirun, a line per job as it ends and the sorted table when the sweep ends."""

    log_start = 0  # sweep.log's size when this sweep began: the table reads the lines it adds

    def on_multirun_start(self, config, **kwargs) -> None:
        log = Path(config.hydra.sweep.dir) / LOG_NAME
        self.log_start = log.stat().st_size if log.is_file() else 0
        if config.hydra.sweeper.get("_target_") == BASIC_SWEEPER:  # a grid's jobs; a search sweeper draws its trials
            record_command(config.hydra.sweep.dir, config.hydra)  # before Hydra's multirun.yaml is this command's alone

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        output_dir = Path(config.hydra.runtime.output_dir)
        fallback = "completed" if job_return.status == JobStatus.COMPLETED else "failed"
        report(job_line(output_dir, fallback, job_outcome.noted(output_dir)), Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config, **kwargs) -> None:
        from normlab.train.ending import drain  # the jobs' ends handed to the end thread (any launcher) come first

        drain()
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            report(sweep_table(sweep_dir, self.log_start), sweep_dir)
