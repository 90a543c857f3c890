"""Where a run's time goes: seconds by phase, recorded in summary.json's `phases`.

    startup      the process's start (its imports, Hydra's composition, the checks) until train() begins; for a
                 later job in the same process (a sweep's), from the previous job's end
    setup        train()'s own bookkeeping: the lock, resume checks, config.json, the tokenizer, summary.json
    data         reading (or the cache of) the corpus and tokenizing it, the held-out batches
    model        building the model, its optimizer and the callbacks (torch.compile only wraps it here), a
                 checkpoint's restore
    sinks        opening and finishing the sinks (wandb's start and finish, metrics.jsonl)
    compile      the first training step: torch.compile's compilation, CUDA's and the kernels' first use
    train        the other training steps, telemetry and the callbacks between them included
    eval         the evaluations on the held-out batches
    checkpoint   saving checkpoints
    products     the end-of-run products: the per-layer table and heatmaps
They are measured one by one (nothing is a remainder), so their sum is the job's time: `startup` plus
summary.json's wall_time_s, less what no phase covers (a few milliseconds). A sweep's job hands its end
over (normlab.train.ending): its `products` and the `sinks`' finish then run while the next job does, and
the next job's `startup` counts from the hand-over, so a sweep's phases may add up to more than its slots'
time. A resumed run's phases are its last segment's (its process's); its wall_time_s counts every segment (RunClock).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

# When this process's previous run (a sweep's job) ended, by time.time(); None before the first.
_last_end: float | None = None


class Phases:
    """Seconds by phase, added up as the run goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def total(self, names) -> float:
        """The seconds of the phases `names` together."""
        return sum(self.seconds.get(name, 0.0) for name in names)

    def record(self) -> dict[str, float]:
        """The phases for summary.json, in milliseconds' precision."""
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}


def startup_seconds(now: float | None = None) -> float | None:
    """Seconds since this process started, or since its previous run ended (the later); None where the process's
    start cannot be read (not Linux)."""
    now = time.time() if now is None else now
    start = _last_end if _last_end is not None else process_start()
    return None if start is None else max(0.0, now - start)


def run_ended(now: float | None = None) -> None:
    """A run of this process ended: the next one's startup counts from here."""
    global _last_end
    _last_end = time.time() if now is None else now


def process_start() -> float | None:
    """This process's start, by time.time(), from /proc: its start in clock ticks after the boot, against the
    uptime (both to 10 ms; /proc/stat's boot time is in whole seconds)."""
    try:
        stat = Path(f"/proc/{os.getpid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22 of the whole line: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class RunClock:
    """A run's wall time across its segments: a run stopped and resumed ran in several processes. `earlier`: the
    segments before this one, as the checkpoint it resumed from recorded them (from_step, to_step, wall_time_s: each
    counted up to the checkpoint the next one resumed from, since the steps after it were trained again); this
    segment began at `started` (time.time()) at step `start_step`."""

    def __init__(self, started: float, start_step: int = 0, earlier: Sequence[Mapping[str, Any]] = ()):
        self.started, self.start_step, self.earlier = started, start_step, [dict(s) for s in earlier]

    @classmethod
    def resuming(cls, started: float, checkpoint) -> "RunClock":
        """The clock of a run that began its segment at `started` and resumes `checkpoint` (None: a fresh start)."""
        return cls(started) if checkpoint is None else cls(started, checkpoint.step, checkpoint.segments)

    def segments(self, to_step: int | None, now: float | None = None) -> list[dict[str, Any]]:
        """Every segment of the run, this one until `now` (default: now), at step `to_step`."""
        seconds = (time.time() if now is None else now) - self.started
        return [*self.earlier, {"from_step": self.start_step, "to_step": to_step, "wall_time_s": round(seconds, 3)}]

    def record(self, summary: dict[str, Any]) -> None:
        """Into `summary`: wall_time_s, the run's until now, every segment's; and for a resumed run, `segments`."""
        now = time.time()
        summary["wall_time_s"] = round(sum(s["wall_time_s"] for s in self.earlier) + now - self.started, 3)
        if self.earlier:
            summary["segments"] = self.segments(summary.get("steps", summary.get("preempted_step")), now)
