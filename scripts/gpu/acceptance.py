"""GPU acceptance: the GPU figures the docs quote, measured stage by stage under wall-clock budgets, kept as it goes.

    python scripts/gpu/acceptance.py [--smoke] [--out DIR] [--stage NAME ...] [--budget NAME=SECONDS ...]

On a GPU machine without network access (carrying .whl; see docs/speed.md#gpu-acceptance):
    source .whl/setup.sh && python3 scripts/gpu/acceptance.py --out $OUT --stage NAME ...
The two prepared commands run it: scripts/gpu/ablation72.sh (the 72-run ablation, within 9 minutes) and
scripts/gpu/acceptance.sh (the rest of what the docs need, within 10).

The stages (scripts/gpu/acceptance_stages.py; default: all, in its order) run one after another, each in a process
of its own with a wall-clock budget. After each stage DIR/gpu-acceptance.json (device, torch, cuda, commit,
started, and the figures: name, value, unit, target, control, verdict, reference, command, detail, timing) and the
table DIR/gpu-acceptance.md are rewritten whole (atomically). A timed figure's `timing` keeps each variant's median,
quartiles and raw per-window seconds; an overhead figure's `control` is its A/A difference, and its verdict is
"inconclusive" where that exceeds the target. A stage that fails or runs past its budget records
value null and why, and the next one runs; the figures a stage reported before it was cut off are kept. A stage
that ends early leaves its unused time to the next: the run never takes longer than the budgets' sum.
SIGTERM or SIGINT (a time limit's signal, Ctrl-C) stops the stage in flight, records it "cut off", writes the
files and exits 128 + the signal. DIR defaults to outputs/gpu-acceptance/; a run's files become a dated record
in docs/benchmarks/ by hand. `--smoke`: every stage at a tiny size on the CPU, same figure names (default DIR:
outputs/gpu-acceptance-smoke/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from acceptance_stages import STAGES  # noqa: E402
from gpu_stage import ROOT, Context, Stage  # noqa: E402

BY_NAME = {stage.name: stage for stage in STAGES}
OPS = {">=": lambda v, t: v >= t, "<=": lambda v, t: v <= t, "==": lambda v, t: v == t}
# A figure's keys in the JSON, in order; `control` and `timing` are null for a figure that is not timed in windows.
KEYS = ("name", "value", "unit", "target", "control", "verdict", "reference", "command", "detail", "timing")


class CutOff(Exception):
    """A signal reached the driver while a stage was in flight."""


class Signals:
    """SIGTERM and SIGINT (a time limit's signal, Ctrl-C): noted; while a stage is in flight, also raised
    as CutOff, so the stage is stopped at once. Elsewhere the driver stops after writing the files."""

    def __init__(self):
        self.received: int | None = None
        self.waiting = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame) -> None:
        self.received = signum
        if self.waiting:
            self.waiting = False
            raise CutOff(signal.Signals(signum).name)


def verdict(value: Any, target: str | None, ok: bool = True, control: float | None = None) -> str | None:
    """`value` against `target` ("<op> <number, true or false>"): "met" or "missed" (missed too where not `ok`); but
    "inconclusive" where the A/A `control` differs by more than the target's number (the comparison's noise floor
    is above what it must show); None without a value or a target."""
    if value is None or target is None:
        return None
    op, want = target.split(" ", 1)
    bound = {"true": True, "false": False}[want] if want in ("true", "false") else float(want)
    if control is not None and abs(control) > abs(bound):
        return "inconclusive"
    return "met" if OPS[op](value, bound) and ok else "missed"


def environment(smoke: bool, argv: list[str]) -> dict[str, Any]:
    """The header of the JSON: device, torch, cuda, commit (None outside a git checkout; whether tracked files
    differ from it), started, the command (with `argv`), and the machine's CPUs and load."""
    import torch

    if smoke or not torch.cuda.is_available():
        device = "cpu: " + next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").open()
                                 if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "cpu"
    else:  # nvidia-smi, so that this process makes no CUDA context of its own
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        device = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "cuda"
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
    commit = git.stdout.strip() if git.returncode == 0 else None
    return {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit,
            "uncommitted_changes": bool(dirty.stdout.strip()) if commit else None,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "smoke": smoke,
            "command": " ".join(["python scripts/gpu/acceptance.py", *argv]),
            "cpus": os.cpu_count(), "load_average": [round(v, 2) for v in os.getloadavg()]}


class Report:
    """The JSON and the markdown table, rewritten whole after every change."""

    def __init__(self, out: Path, header: dict[str, Any], stages: list[Stage], budgets: dict[str, float],
                 previous: dict[str, Any] | None = None):
        """`previous`: an earlier gpu-acceptance.json of this device, whose stages not in `stages` are kept."""
        self.out, self.header = out, header
        old_figures = {f["name"]: f for f in (previous or {}).get("figures", [])}
        old_stages = {s["name"]: s for s in (previous or {}).get("stages", [])}
        self.figures, self.stages = {}, {}
        for stage in STAGES:
            if stage in stages:
                self.stages[stage.name] = {"name": stage.name, "budget_s": budgets[stage.name], "wall_s": None,
                                           "status": "not reached"}
                self.figures.update({f.name: {**dict.fromkeys(KEYS), "name": f.name, "unit": f.unit, "target": f.target,
                                              "detail": "not reached"} for f in stage.figures})
            elif stage.name in old_stages and all(f.name in old_figures for f in stage.figures):
                self.stages[stage.name] = {**old_stages[stage.name], "kept_from": previous["started"]}
                self.figures.update({f.name: {**dict.fromkeys(KEYS), **old_figures[f.name]} for f in stage.figures})

    def record(self, stage: Stage, results: dict[str, dict], wall: float, status: str, why: str | None) -> None:
        """A stage's end: its reported figures, and `why` (None: it finished) for those it did not report."""
        for f in stage.figures:
            got = results.get(f.name)
            entry = self.figures[f.name]
            if got:
                entry.update({k: got.get(k) for k in ("value", "control", "reference", "command", "detail", "timing")})
                entry["verdict"] = verdict(got["value"], f.target, got.get("ok", True), got.get("control"))
            else:
                entry.update(value=None, control=None, verdict=None, timing=None,
                             detail=why or "the stage ended without reporting it")
        self.stages[stage.name].update(wall_s=round(wall, 1), status=status)
        self.write()

    def write(self) -> None:
        from normlab.util.files import write_bytes_atomic, write_json_atomic

        doc = {**self.header, "figures": list(self.figures.values()), "stages": list(self.stages.values())}
        write_json_atomic(self.out / "gpu-acceptance.json", doc)
        write_bytes_atomic(self.out / "gpu-acceptance.md", self.markdown().encode())

    def markdown(self) -> str:
        h = self.header
        lines = [f"# GPU acceptance{' (smoke: tiny sizes on the CPU, not GPU figures)' if h['smoke'] else ''}", "",
                 f"{h['device']}; torch {h['torch']}, CUDA {h['cuda']}; commit {h['commit']}; started {h['started']}; "
                 f"load average at the start {h.get('load_average')}", "",
                 "| figure | value | unit | target | A/A | verdict | reference | detail |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for f in self.figures.values():
            cells = [f["name"], "null" if f["value"] is None else json.dumps(f["value"]), f["unit"], f["target"] or "",
                     "" if f["control"] is None else json.dumps(f["control"]),
                     {"missed": "**missed**", None: ""}.get(f["verdict"], f["verdict"]), f["reference"] or "", f["detail"]]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
        lines += ["", "| stage | budget s | wall s | status |", "| --- | --- | --- | --- |"]
        lines += [f"| {s['name']} | {s['budget_s']:g} | {s['wall_s'] if s['wall_s'] is not None else ''} | {s['status']} |"
                  for s in self.stages.values()]
        return "\n".join(lines) + "\n"


def stage_budget(budgets: list[float], i: int, elapsed: float) -> float:
    """Stage i's seconds: its own budget and what the stages before it left unused of theirs, keeping the
    later stages' budgets whole, so the run ends within the budgets' sum."""
    return round(max(budgets[i], sum(budgets[: i + 1]) - elapsed), 1)


def previous_run(path: Path, header: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON an earlier run of this script left at `path`, if it measured the same device in the same mode."""
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = all(previous.get(key) == header[key] for key in ("device", "smoke"))
    return previous if same else None


def run_stage(stage: Stage, budget: float, smoke: bool, log, scratch: Path, signals: Signals,
              out: Path | None = None) -> tuple[dict, float, str, str | None]:
    """The stage in a process (and process group) of its own, stopped at `budget` seconds or by a signal: its
    results, wall time, status and, where it did not finish, why. Files it writes beside the JSON go to `out`."""
    result = scratch / f"{stage.name}.json"
    command = [sys.executable, __file__, "--child", stage.name, "--result", str(result), "--seconds", str(budget),
               *(["--out", str(out)] if out else []), *(["--smoke"] if smoke else [])]
    log.write(f"\n===== stage {stage.name} (budget {budget:g} s), {time.strftime('%H:%M:%S')} =====\n")
    log.flush()
    started = time.perf_counter()
    # A process group, not a session: what ends this command's session (a machine's clean-up after a time limit)
    # still ends the stage if this process is killed outright.
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    try:
        signals.waiting = True
        if signals.received:  # it came while the stage was starting (the main loop checks before each stage)
            signals.waiting = False
            raise CutOff(signal.Signals(signals.received).name)
        code = proc.wait(timeout=budget)
        signals.waiting = False
        status, why = ("ok", None) if code == 0 else ("failed", f"failed (exit code {code})")
    except subprocess.TimeoutExpired:
        signals.waiting = False
        stop(proc)
        status, why = "over budget", f"ran past its budget of {budget:g} s and was stopped"
    except CutOff as cut:
        stop(proc)
        status, why = "cut off", f"cut off by {cut} after {time.perf_counter() - started:.0f} s"
    results = read_results(result)
    if status == "failed" and "error" in results:
        why = f"failed: {results['error']}"
    return results, time.perf_counter() - started, status, why


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group (normlab runs in it checkpoint and stop), SIGKILL after 10 s."""
    for signum, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_results(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def child(name: str, result: Path, smoke: bool, out: Path | None = None, seconds: float | None = None) -> int:
    """Run one stage in this process within `seconds`; its figures go to `result` as it reports them, its files to
    `out` (by default its scratch dir)."""
    from normlab.util.files import write_json_atomic

    with tempfile.TemporaryDirectory(prefix=f"acceptance-{name}-") as workdir:
        ctx = Context(smoke, result, Path(workdir), out, seconds)
        try:
            BY_NAME[name].run(ctx)
        except Exception as error:  # the driver records it as the stage's reason; the traceback goes to the log
            import traceback

            traceback.print_exc()
            write_json_atomic(result, {**ctx.results, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            return 1
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every stage at a tiny size on the CPU")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of gpu-acceptance.json and .md (default: outputs/gpu-acceptance/; "
                             "with --smoke: outputs/gpu-acceptance-smoke/)")
    parser.add_argument("--stage", nargs="+", action="extend", default=None, metavar="NAME",
                        help=f"stages to run, in the script's order (default: all): {', '.join(BY_NAME)}")
    parser.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS",
                        help="another wall-clock budget for a stage (repeatable)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def budgets(args: argparse.Namespace) -> dict[str, float] | str:
    """Each stage's budget (the GPU's, or the smoke's, then --budget's); a string names what is wrong."""
    out = {s.name: s.smoke_budget_s if args.smoke else s.budget_s for s in STAGES}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in out or value <= 0:
            return f"--budget {item}: give NAME=SECONDS with a stage of {', '.join(BY_NAME)} and seconds > 0"
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child, args.result, args.smoke, args.out, args.seconds)
    unknown = [name for name in args.stage or () if name not in BY_NAME]
    limits = budgets(args)
    problem = (f"unknown stage {unknown[0]!r}: choose from {', '.join(BY_NAME)}" if unknown
               else limits if isinstance(limits, str) else None)
    if not problem and not args.smoke:
        import torch

        if not torch.cuda.is_available():
            problem = "no CUDA device here: --smoke runs every stage at a tiny size on the CPU"
    if problem:
        print(f"gpu_acceptance: error: {problem}", file=sys.stderr)
        return 2
    chosen = args.stage
    stages = [s for s in STAGES if chosen is None or s.name in chosen]
    out = args.out or ROOT / ("outputs/gpu-acceptance-smoke" if args.smoke else "outputs/gpu-acceptance")
    out.mkdir(parents=True, exist_ok=True)
    signals = Signals()
    header = environment(args.smoke, sys.argv[1:] if argv is None else argv)
    report = Report(out, header, stages, limits, previous_run(out / "gpu-acceptance.json", header) if chosen else None)
    report.write()
    started = time.perf_counter()
    with (out / "gpu-acceptance.log").open("a") as log, tempfile.TemporaryDirectory(prefix="acceptance-") as scratch:
        for i, stage in enumerate(stages):
            if signals.received:
                break
            budget = stage_budget([limits[s.name] for s in stages], i, time.perf_counter() - started)
            report.stages[stage.name]["budget_s"] = budget
            results, wall, status, why = run_stage(stage, budget, args.smoke, log, Path(scratch), signals, out)
            report.record(stage, results, wall, status, why)
            print(f"gpu_acceptance: {stage.name}: {status} in {wall:.1f} s" + (f" ({why})" if why else ""), flush=True)
    if signals.received:
        print(f"gpu_acceptance: stopped by {signal.Signals(signals.received).name}; what was reached is in {out}")
        return 128 + signals.received
    print(f"gpu_acceptance: {len(stages)} stages in {time.perf_counter() - started:.0f} s; {out / 'gpu-acceptance.md'}:")
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
