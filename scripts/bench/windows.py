"""Timed windows: a step's time measured over windows of steps on the device's own clock, the windows' median and
interquartile range, and the A/A control that gives a comparison its noise floor.

A window is the steps between two marks. On a CUDA device a mark is an event recorded on the current stream, and a
window's time is the elapsed time between two events, read once the last has completed: the device's timeline, which
a host sync inside the window does not lengthen and a host running ahead of the device does not shorten. On the CPU,
where a step's work is done when its call returns, a mark is time.perf_counter().

Variants are timed interleaved, round after round (A, A', B, A, A', B, ...), so that a drift of the machine (its
clocks, other work on it) falls on every variant alike. A' is A again (`again(name)`): the difference between A and
A' is the noise floor of a comparison of B with A.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from normlab.train.callbacks import Callback

MIN_WINDOWS = 20  # the timed windows per variant a GPU figure rests on, at least
AGAIN = " again"  # the suffix of the A/A control's second copy of a variant


def again(name: str) -> str:
    """The A/A control's name for a second copy of variant `name`."""
    return name + AGAIN


def variant_of(name: str) -> str:
    """The variant a name runs: `normlab eager again` runs `normlab eager`."""
    return name.removesuffix(AGAIN)


class DeviceClock:
    """Marks on the device's timeline (CUDA events on the current stream; perf_counter on the CPU) and the seconds
    between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between each mark and the next (on CUDA, once the last mark's event has completed)."""
        if not self.cuda:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        if self.marks:
            self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]


class StepMarks(Callback):
    """Marks `clock` as each `every`-th step of a run ends (steps 0, every, 2 every, ...: the logged ones), after every
    other callback and sink of that step."""

    name = "step_marks"

    def __init__(self, clock: DeviceClock, every: int):
        self.clock, self.every = clock, every

    def on_step_end(self, state, record) -> None:
        if (state.step - 1) % self.every == 0:  # state.step counts the updates taken: the step that ended is one less
            self.clock.mark()


def spread(seconds: Sequence[float]) -> dict[str, float]:
    """The median of per-window times, their quartiles and interquartile range, and how many windows there were."""
    q1, median, q3 = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else [seconds[0]] * 3
    return {"median": median, "q1": q1, "q3": q3, "iqr": q3 - q1, "windows": len(seconds)}


def describe(seconds: Sequence[float]) -> str:
    """'25.10 ms/step (IQR 24.80–25.60 ms, 20 windows)'."""
    s = spread(seconds)
    return f"{1e3 * s['median']:.2f} ms/step (IQR {1e3 * s['q1']:.2f}–{1e3 * s['q3']:.2f} ms, {s['windows']} windows)"


def interleaved(names: Sequence[str], rounds: int, run: Callable[[str], list[float]]) -> dict[str, list[float]]:
    """Each name's per-window seconds per step, from `run(name)` called round after round in the order of `names`."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            times[name] += run(name)
    return times


def median_ratio(times: dict[str, list[float]], over: str, under: str) -> float:
    return statistics.median(times[over]) / statistics.median(times[under])


def overhead(times: dict[str, list[float]], base: str, treated: str) -> tuple[float, float | None]:
    """What `treated` adds to `base`'s step time, in per cent of it (medians), and the A/A control's difference, A'
    over A in per cent (None without A')."""
    control = again(base)
    return (100 * (median_ratio(times, treated, base) - 1),
            100 * (median_ratio(times, control, base) - 1) if control in times else None)


def timing(times: dict[str, list[float]], clock: str) -> dict[str, Any]:
    """What a figure's JSON keeps of its timing: the clock, and each variant's spread and raw per-window times."""
    return {"clock": clock, "order": "interleaved, round after round: " + ", ".join(times),
            "seconds_per_step": {name: {**spread(s), "raw": list(s)} for name, s in times.items()}}
