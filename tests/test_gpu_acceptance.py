"""scripts/gpu/acceptance.py on the CPU (--smoke): the JSON and table it keeps, stage by stage, and what it records
for a stage that fails, runs past its budget, or is cut off by SIGTERM, and for a sweep whose runs fail. The whole
smoke run takes minutes; these run its quickest stage (the suite's smoke subset), stop the others early, and
stand a fake in for the sweeps' commands."""

import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS / "gpu"))

import acceptance as gpu_acceptance  # noqa: E402
import ablation72_stage  # noqa: E402
import acceptance_stages  # noqa: E402
import gpu_stage  # noqa: E402  (it puts scripts/bench/ on sys.path)
import speed_stages  # noqa: E402
import suite_stages  # noqa: E402
import sweep_stages  # noqa: E402
import sweep_throughput  # noqa: E402

KEYS = {"name", "value", "unit", "target", "control", "verdict", "reference", "command", "detail", "timing"}


def start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPTS / "gpu/acceptance.py"), "--smoke", "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "WANDB_MODE": "disabled"})


def figures(out: Path) -> dict[str, dict]:
    doc = json.loads((out / "gpu-acceptance.json").read_text())
    assert {"device", "torch", "cuda", "commit", "started", "figures"} <= doc.keys() and doc["smoke"] is True
    assert all(set(f) == KEYS for f in doc["figures"])
    assert doc["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", doc["commit"])  # this checkout's HEAD
    return {f["name"]: f for f in doc["figures"]}


def _collected(path: str) -> int:
    """How many tests pytest collects from `path`."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--collect-only", path],
                          capture_output=True, text=True, cwd=SCRIPTS.parent)
    return int(re.search(r"(\d+) tests? collected", done.stdout).group(1))


def test_a_smoke_stage_measures_its_figures_and_one_past_its_budget_records_null_and_why(tmp_path):
    proc = start(tmp_path, "--stage", "cuda_tests", "deterministic", "--budget", "deterministic=0.5")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    got = figures(tmp_path)
    assert list(got) == ["deterministic_resume_equal", "deterministic_cost", "cuda_tests_failed", "cuda_tests_passed",
                         "cuda_tests_wall_s"]
    failed, passed, wall = got["cuda_tests_failed"], got["cuda_tests_passed"], got["cuda_tests_wall_s"]
    assert failed["value"] == 0 and failed["verdict"] == "met" and failed["target"] == "== 0"
    cuda_tests = _collected("tests/test_cuda.py")
    assert passed["value"] == (cuda_tests if torch.cuda.is_available() else 0) and passed["verdict"] is None  # no target
    assert failed["detail"] == passed["detail"]
    assert failed["detail"].startswith(f"{cuda_tests} {'passed' if torch.cuda.is_available() else 'skipped'} in ")
    assert 0 < wall["value"] < 600 and wall["command"] == "python -m pytest -q -n 0 --durations=0 tests/test_cuda.py"
    for name in ("deterministic_resume_equal", "deterministic_cost"):  # the stage before: over budget
        assert got[name]["value"] is None and got[name]["verdict"] is None
        assert got[name]["detail"] == "ran past its budget of 0.5 s and was stopped"
    table = (tmp_path / "gpu-acceptance.md").read_text()
    assert "| cuda_tests_failed | 0 | tests | == 0 |  | met |" in table and f"| cuda_tests_passed | {passed['value']} | tests |" in table
    assert "| deterministic_resume_equal | null |" in table and "| deterministic | 0.5 |" in table
    assert "===== stage cuda_tests" in (tmp_path / "gpu-acceptance.log").read_text()


def test_sigterm_cuts_off_the_stage_in_flight_and_leaves_valid_files(tmp_path):
    proc = start(tmp_path, "--stage", "suite", "torchrun")
    deadline = time.monotonic() + 120
    while "===== stage suite" not in ((tmp_path / "gpu-acceptance.log").read_text()
                                      if (tmp_path / "gpu-acceptance.log").exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    got = figures(tmp_path)
    assert got["suite_failed"]["value"] is None and got["suite_failed"]["detail"].startswith("cut off by SIGTERM")
    assert got["torchrun_cpu2_ok"]["detail"] == "not reached"
    stages = {s["name"]: s["status"] for s in json.loads((tmp_path / "gpu-acceptance.json").read_text())["stages"]}
    assert stages == {"suite": "cut off", "torchrun": "not reached"}
    assert "stopped by SIGTERM" in out


def test_a_failing_stage_records_null_with_its_error_and_a_rerun_keeps_the_other_stages(tmp_path, monkeypatch):
    def broken(ctx):
        ctx.report("sweep8_wall_s", 1.5, "measured before the failure")
        raise RuntimeError("the sweep broke")

    stage = next(s for s in acceptance_stages.STAGES if s.name == "sweep8")
    monkeypatch.setitem(gpu_acceptance.BY_NAME, "sweep8", gpu_stage.Stage(**{**stage.__dict__, "run": broken}))
    assert gpu_acceptance.child("sweep8", tmp_path / "result.json", smoke=True) == 1
    results = gpu_acceptance.read_results(tmp_path / "result.json")
    assert results["error"] == "RuntimeError: the sweep broke"

    header = {"device": "cpu: test", "torch": "x", "cuda": None, "commit": None, "started": "t0", "smoke": True}
    stages = [s for s in acceptance_stages.STAGES if s.name in ("sweep8", "pack21")]
    report = gpu_acceptance.Report(tmp_path, header, stages, {"sweep8": 1, "pack21": 2})
    report.record(stages[0], {k: v for k, v in results.items() if k != "error"}, 3.0, "failed", "failed: " + results["error"])
    report.record(stages[1], {}, 4.0, "failed", "failed: RuntimeError: no pack")
    got = figures(tmp_path)
    assert got["sweep8_wall_s"]["value"] == 1.5 and got["sweep8_wall_s"]["verdict"] == "met"  # reported before it broke
    assert got["pack21_wall_s"]["value"] is None and got["pack21_wall_s"]["detail"] == "failed: RuntimeError: no pack"

    # --stage pack21 again in the same folder keeps sweep8's figure and reruns pack21's
    previous = gpu_acceptance.previous_run(tmp_path / "gpu-acceptance.json", {**header, "started": "t1"})
    again = gpu_acceptance.Report(tmp_path, {**header, "started": "t1"}, stages[1:], {"pack21": 2}, previous)
    assert again.figures["sweep8_wall_s"]["value"] == 1.5 and again.stages["sweep8"]["kept_from"] == "t0"
    assert again.figures["pack21_wall_s"]["detail"] == "not reached"
    assert gpu_acceptance.previous_run(tmp_path / "gpu-acceptance.json", {**header, "device": "other"}) is None


def stamp(seconds: float) -> str:
    """A normlab.log line's start at time.time() `seconds`."""
    moment = datetime.datetime.fromtimestamp(seconds)
    return f"[{moment:%Y-%m-%d %H:%M:%S},{moment.microsecond // 1000:03d}][normlab][INFO] - "


LSE = "RuntimeError: LSE is not correctly aligned (strideH)"  # what every member of the H200's pack raised
DONE = {"status": "completed", "final_val_loss": 2.5}


def fake_sweeps(monkeypatch, sweeps: dict[str, dict[str, dict]]) -> None:
    """run_sweep without running: a sweep dir's name picks its jobs' summaries (each with one metrics row and a
    normlab.log whose first run starts 2 s after the command and whose last ends after 30 s), and every command takes
    38.65 s."""
    def run_sweep(normlab, overrides, sweep_dir, timeout=None, log=None):
        started = time.time()
        for i, (name, summary) in enumerate(sweeps[sweep_dir.name].items()):
            (sweep_dir / str(i)).mkdir(parents=True)
            (sweep_dir / str(i) / "summary.json").write_text(json.dumps({"name": name, **summary}))
            (sweep_dir / str(i) / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 2.5}) + "\n")
            (sweep_dir / str(i) / "normlab.log").write_text(
                f"{stamp(started + 2 + i)}{name}: cuda, bf16, 6,500,000 parameters each\n"
                f"{stamp(started + 30 - i)}{name} completed: final val loss 2.5000 (3.6 bits/byte)\n")
        return 38.65, {name: {"name": name, **summary} for name, summary in sweeps[sweep_dir.name].items()}

    monkeypatch.setattr(sweep_throughput, "run_sweep", run_sweep)


def test_a_pack_whose_members_failed_reports_no_wall_time_and_compares_nothing(tmp_path, monkeypatch):
    failed = {"status": "failed", "error": LSE}
    fake_sweeps(monkeypatch, {"pack21": {f"m{i:02}": failed for i in range(21)}, "packed": {"a": failed, "b": failed},
                              "unpacked": {"a": DONE, "b": DONE}})
    ctx = gpu_stage.Context(True, tmp_path / "result.json", tmp_path)
    sweep_stages.pack21(ctx)
    got = ctx.results["pack21_wall_s"]
    assert got["value"] is None and got["ok"] is False
    assert got["detail"] == (f"21 of 21 members failed: {LSE}; the command took 38.65 s, not a valid figure; members a, b "
                             f"(fp32, 4 steps) against their unpacked runs: not compared, 2 of 2 packed members failed: {LSE}")


@pytest.mark.parametrize("other, value, detail", [
    ({"status": "diverged"}, 38.65, "8 jobs (completed, diverged); final val losses of layer, rms run one after another "
                                    "(jobs_per_gpu=1): largest relative difference 0.00e+00 (tolerance 0)"),
    ({"status": "failed", "error": "RuntimeError: boom"}, None,
     "1 of 8 jobs failed: RuntimeError: boom; the command took 38.65 s, not a valid figure; final val losses of layer, "
     "rms run one after another (jobs_per_gpu=1): not compared, the sweep's jobs did not finish"),
], ids=["diverged", "failed"])
def test_a_sweep_with_a_failed_job_reports_no_wall_time_and_a_diverged_arm_is_an_outcome(tmp_path, monkeypatch, other,
                                                                                        value, detail):
    jobs = {"layer": DONE, "rms": DONE, **{f"arm{i}": DONE for i in range(5)}, "batch-post": other}
    fake_sweeps(monkeypatch, {"sweep8": jobs, "sequential": {"layer": DONE, "rms": DONE}})
    ctx = gpu_stage.Context(True, tmp_path / "result.json", tmp_path)
    sweep_stages.sweep8(ctx)
    got = ctx.results["sweep8_wall_s"]
    assert (got["value"], got["detail"], got["ok"]) == (value, detail, value is not None)


def test_unfinished_counts_the_runs_that_wrote_no_summary():
    assert sweep_throughput.unfinished({"a": DONE}, 1, "jobs") is None
    assert sweep_throughput.unfinished({"a": DONE}, 3, "jobs") == "2 of 3 jobs wrote no summary.json"
    assert sweep_throughput.unfinished({"a": {"status": "preempted"}}, 2, "jobs") == "2 of 2 jobs preempted/wrote no summary.json"


def test_a_stage_gets_the_time_the_stages_before_it_left_unused():
    budgets = [120, 70, 55]
    assert gpu_acceptance.stage_budget(budgets, 0, 0.0) == 120
    assert gpu_acceptance.stage_budget(budgets, 1, 100.0) == 90  # 20 s left over by the first
    assert gpu_acceptance.stage_budget(budgets, 2, 150.0) == 95  # 40 s left over by the first two
    assert gpu_acceptance.stage_budget(budgets, 2, 200.0) == 55  # never less than its own


def test_the_ablation_stage_reports_its_wall_head_failures_projection_and_record_and_compares_two_runs_alone(
        tmp_path, monkeypatch):
    done = {**DONE, "tokens": 1000, "phases": {"train": 2.0, "startup": 1.0}, "phases_shared_by": 4}
    runs = {f"run{i}": done for i in range(6)}
    fake_sweeps(monkeypatch, {"ablation": {**runs, "layer-pre-d2-lr3e-3-s1": done, "rms-pre-d2-lr3e-3-s1": done},
                              "alone": {"layer-pre-d2-lr3e-3-s1": {**DONE, "final_val_loss": 2.5000125},
                                        "rms-pre-d2-lr3e-3-s1": DONE}})
    monkeypatch.setattr(ablation72_stage, "compare", lambda ctx, normlab, sweep_dir, timeout: (1.5, "8 runs in 2 arms."))
    ctx = gpu_stage.Context(True, tmp_path / "result.json", tmp_path)
    ablation72_stage.ablation72(ctx)
    got = {name: (r["value"], r["ok"]) for name, r in ctx.results.items()}
    assert list(got) == ["ablation72_wall_s", "ablation72_head_s", "ablation72_failed", "ablation72_compare_s",
                         "ablation72_2000_projected_s", "ablation72_packed_vs_alone"]
    assert got["ablation72_wall_s"] == (38.65, True) and got["ablation72_failed"] == (0, True)
    assert got["ablation72_head_s"][0] == pytest.approx(2.0, abs=0.05) and got["ablation72_compare_s"][0] == 1.5
    # head 2 s + (30 - 2) s of packs x 4 (4 steps -> 16) + tail 38.65 - 30 s
    assert got["ablation72_2000_projected_s"][0] == pytest.approx(2 + 28 * 4 + 8.65, abs=0.1)
    assert "projected, not measured" in ctx.results["ablation72_2000_projected_s"]["detail"]
    assert got["ablation72_packed_vs_alone"] == (5e-06, True)
    wall = ctx.results["ablation72_wall_s"]
    assert wall["detail"].startswith("8 runs (completed); 0.0M tokens, 207 tokens/s over the whole command; time by phase, "
                                     "summed over the jobs: train 4.0 s (67%), startup 2.0 s (33%)")
    assert "pack=true" in wall["command"] and "hydra.launcher.jobs_per_gpu=4" in wall["command"]
    record = (tmp_path / "ablation72-smoke.md").read_text()
    assert "```text\n8 runs in 2 arms.\n```" in record and "| `ablation72_packed_vs_alone` | 5e-06 |" in record


def test_the_ablation_stage_counts_the_runs_that_failed_and_marks_runs_alone_that_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(ablation72_stage, "compare", lambda ctx, normlab, sweep_dir, timeout: (1.5, "answer"))
    alone = {"layer-pre-d2-lr3e-3-s1": DONE, "rms-pre-d2-lr3e-3-s1": DONE}
    failed = {**{f"run{i}": DONE for i in range(7)}, "x": {"status": "failed", "error": "RuntimeError: boom"}}
    fake_sweeps(monkeypatch, {"ablation": failed, "alone": alone})
    ctx = gpu_stage.Context(True, tmp_path / "a" / "result.json", tmp_path / "a")
    ablation72_stage.ablation72(ctx)
    wall, bad = ctx.results["ablation72_wall_s"], ctx.results["ablation72_failed"]
    assert wall["value"] is None and "1 of 8 runs failed: RuntimeError: boom" in wall["detail"]
    assert bad["value"] == 1 and bad["detail"].endswith("the first error: RuntimeError: boom")
    assert gpu_acceptance.verdict(bad["value"], "== 0", bad["ok"]) == "missed"
    far = {**{f"run{i}": DONE for i in range(6)}, **alone, "rms-pre-d2-lr3e-3-s1": {**DONE, "final_val_loss": 2.6}}
    fake_sweeps(monkeypatch, {"ablation": far, "alone": alone})
    ctx = gpu_stage.Context(True, tmp_path / "b" / "result.json", tmp_path / "b")
    ablation72_stage.ablation72(ctx)
    got = ctx.results["ablation72_packed_vs_alone"]
    assert got["value"] == 0.04 and got["ok"] is False and "difference of final val loss 4.00e-02" in got["detail"]


def test_the_ablation_script_runs_the_grid_then_compare_and_writes_the_record_on_the_cpu(tmp_path):
    """scripts/gpu/ablation72.sh --smoke: the stage's real commands on a tiny grid (8 runs in 2 packs), then
    normlab compare; the figures, the record with compare's answer, and compare's report dir come back under OUT."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPTS / "gpu/ablation72.sh"), "--smoke"], cwd=SCRIPTS.parent, text=True,
                          capture_output=True, env={**os.environ, "OUT": str(out), "WANDB_MODE": "disabled"}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((out / "gpu-acceptance.json").read_text())
    assert doc["command"].endswith("--stage ablation72 --smoke") and doc["commit"] and doc["started"]
    got = figures(out)
    assert got["ablation72_wall_s"]["value"] > 0 and got["ablation72_failed"]["value"] == 0
    assert 0 < got["ablation72_head_s"]["value"] < got["ablation72_wall_s"]["value"]
    assert got["ablation72_2000_projected_s"]["value"] > got["ablation72_wall_s"]["value"]
    record = (out / "ablation72-smoke.md").read_text()
    assert f"commit {doc['commit']}" in record and "8 runs in 2 arms." in record and "95% interval" in record
    with tarfile.open(out / "ablation72-report.tar.gz") as tar:
        assert {"report/report.md", "report/arms.csv", "report/runs.csv"} <= set(tar.getnames())
    assert "sweep: 8 jobs (8 completed)" in (out / "ablation72-sweep.log").read_text()


@pytest.mark.parametrize("script, limit", [("ablation72.sh", 540), ("acceptance.sh", 600)])
def test_each_prepared_command_fits_its_time(script, limit):
    """On a GPU the script's timeout holds its stages' budgets and the driver's start and end (30 s), and with the
    set-up of .whl (30 s) it ends within `limit`: ablation72.sh within 9 minutes, acceptance.sh within one
    command's 10."""
    text = (SCRIPTS / "gpu" / script).read_text()
    timeout = int(re.search(r'^  ""\) smoke=\(\); limit=(\d+) ;;', text, re.M).group(1))
    stages = re.search(r"^timeout \$limit python3 scripts/gpu/acceptance.py --out \"\$OUT\" --stage ([\w ]+) \"\$", text,
                       re.M).group(1).split()
    budgets = {stage.name: stage.budget_s for stage in acceptance_stages.STAGES}
    assert set(stages) <= set(budgets)
    assert sum(budgets[name] for name in stages) + 30 <= timeout and timeout + 30 <= limit


def test_the_ablation_script_refuses_an_unknown_argument_in_one_line_and_writes_nothing(tmp_path):
    done = subprocess.run(["bash", str(SCRIPTS / "gpu/ablation72.sh"), "--fast"], cwd=SCRIPTS.parent, text=True,
                          capture_output=True, env={**os.environ, "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and not (tmp_path / "out").exists()
    assert done.stderr == "ablation72.sh: error: unknown arguments '--fast': give --smoke or nothing\n"


@pytest.mark.parametrize("value, target, ok, control, expected", [
    (1.02, ">= 1.0", True, None, "met"), (0.98, ">= 1.0", True, None, "missed"), (3.5, "<= 3", True, None, "missed"),
    (12.0, "<= 20", False, None, "missed"), (True, "== true", True, None, "met"), (False, "== true", True, None, "missed"),
    (0, "== 0", True, None, "met"), (None, "<= 3", True, None, None), (5, None, True, None, None),
    # an overhead beside its A/A control: within the target's noise floor the value decides; beyond it, nothing does
    (2.0, "<= 3", True, 0.8, "met"), (3.5, "<= 3", True, -2.9, "missed"), (2.0, "<= 3", True, 3.4, "inconclusive"),
    (40.0, "<= 3", True, -3.01, "inconclusive"), (12.0, None, True, 9.0, None),
    (False, "== false", True, None, "met"), (True, "== false", True, None, "missed"),
])
def test_verdict_compares_a_value_with_its_target_unless_its_a_a_control_is_above_it(value, target, ok, control, expected):
    assert gpu_acceptance.verdict(value, target, ok, control) == expected


def test_an_overhead_runs_a_a_prime_and_b_interleaved_and_its_figure_is_the_ratio_of_medians(tmp_path, monkeypatch):
    import step_speed_gpu

    calls, step_s = [], {"normlab eager": 0.010, "normlab eager again": 0.0105, "normlab eager telemetry/2": 0.0112}

    def run_variant(name, overrides, args, device):
        calls.append(name)
        n = calls.count(name)
        times = [step_s[name] * (1 + 0.01 * ((i + n) % 3 - 1)) for i in range(args.windows)]  # 0.99, 1.00, 1.01 x
        return {"step_s": times, "cfg": speed_stages_cfg()}

    monkeypatch.setattr(step_speed_gpu, "run_variant", run_variant)
    ctx = gpu_stage.Context(True, tmp_path / "result.json", tmp_path)
    speed_stages.telemetry_overheads(ctx, (("medium", "eager"),))
    assert calls == ["normlab eager", "normlab eager again", "normlab eager telemetry/2"] * 2  # A, A', B, A, A', B
    got = ctx.results["telemetry_overhead_eager"]
    assert got["value"] == pytest.approx(12.0, abs=0.01) and got["control"] == pytest.approx(5.0, abs=0.01)
    kept = got["timing"]["seconds_per_step"]
    assert got["timing"]["clock"] == "perf_counter" and list(kept) == list(step_s)
    for name, seconds in step_s.items():
        assert len(kept[name]["raw"]) == 20 and kept[name]["windows"] == 20  # 2 rounds x 10 windows, every one kept
        assert kept[name]["median"] == pytest.approx(seconds) and kept[name]["q1"] < seconds < kept[name]["q3"]
    assert gpu_acceptance.verdict(got["value"], "<= 3", got["ok"], got["control"]) == "inconclusive"  # 5% > 3%


def speed_stages_cfg():
    from types import SimpleNamespace

    return SimpleNamespace(depth=2, model=SimpleNamespace(d_model=32), seq_len=16, batch_size=4, precision="fp32")


def test_a_smoke_overhead_keeps_its_a_a_control_and_every_windows_time_in_the_json_and_the_table(tmp_path):
    """The telemetry figure's real code on the CPU (train() runs of the tiny model, perf_counter windows): the A/A
    control beside it, each variant's raw per-window times, and a verdict that follows them."""
    ctx = gpu_stage.Context(True, tmp_path / "result.json", tmp_path)
    speed_stages.telemetry_overheads(ctx, (("medium", "eager"),))
    stage = next(s for s in acceptance_stages.STAGES if s.name == "telemetry")
    header = {"device": "cpu: test", "torch": "x", "cuda": None, "commit": None, "started": "t0", "smoke": True}
    report = gpu_acceptance.Report(tmp_path, header, [stage], {"telemetry": 1})
    report.record(stage, ctx.results, 1.0, "ok", None)
    got = figures(tmp_path)["telemetry_overhead_eager"]
    kept = got["timing"]["seconds_per_step"]
    assert list(kept) == ["normlab eager", "normlab eager again", "normlab eager telemetry/2"]
    assert all(len(v["raw"]) >= 20 and v["median"] == pytest.approx(statistics.median(v["raw"])) for v in kept.values())
    base = kept["normlab eager"]["median"]
    assert got["value"] == pytest.approx(100 * (kept["normlab eager telemetry/2"]["median"] / base - 1), abs=0.006)
    assert got["control"] == pytest.approx(100 * (kept["normlab eager again"]["median"] / base - 1), abs=0.006)
    assert got["verdict"] == ("inconclusive" if abs(got["control"]) > 3 else "met" if got["value"] <= 3 else "missed")
    row = next(line for line in (tmp_path / "gpu-acceptance.md").read_text().splitlines()
               if line.startswith("| telemetry_overhead_eager |"))
    shown = {"missed": "**missed**"}.get(got["verdict"], got["verdict"])
    assert row.startswith(f"| telemetry_overhead_eager | {json.dumps(got['value'])} | % | <= 3 | "
                          f"{json.dumps(got['control'])} | {shown} |")


@pytest.mark.parametrize("args, message", [
    (["--stage", "gpt3"], "unknown stage 'gpt3': choose from gpt2, medium_graphs,"),
    (["--budget", "suite=soon"], "--budget suite=soon: give NAME=SECONDS with a stage of gpt2,"),
    (["--budget", "nothing=5"], "--budget nothing=5: give NAME=SECONDS"),
])
def test_bad_arguments_give_one_line_and_write_nothing(tmp_path, capsys, args, message):
    assert gpu_acceptance.main(["--smoke", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu_acceptance: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_processes_still_holding_a_stopped_sweeps_output_are_named(tmp_path):
    """What mps_sigterm writes where a sweep's output stays open after SIGTERM: each process holding it, in the
    sweep's session or one of its own."""
    import mps_stage

    read, write = os.pipe()
    child = subprocess.Popen(["sleep", "30"], stdout=write, start_new_session=True)
    os.close(write)
    try:
        cmdline = Path(f"/proc/{child.pid}/cmdline")
        deadline = time.monotonic() + 10
        while b"sleep" not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # the child has forked but not yet exec'd sleep (a loaded machine)
        holders = mps_stage.pipe_holders(read)
        assert [(h["pid"], h["comm"], h["session"], h["cmdline"]) for h in holders] == \
            [(child.pid, "sleep", str(child.pid), "sleep 30 ")]
        assert holders[0]["state"] in "SR" and holders[0]["wchan"]
        assert [(p["pid"], p["comm"]) for p in mps_stage.session_processes(child.pid)] == [(child.pid, "sleep")]
        mps_stage.kill_session(child.pid)
        assert child.wait(timeout=10) == -signal.SIGKILL and mps_stage.pipe_holders(read) == []
    finally:
        child.kill()
        os.close(read)


def test_the_device_slug_names_the_gpu():
    assert gpu_stage.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_stage.device_slug("NVIDIA H200") == "h200"
    assert gpu_stage.device_slug("Some Card") == "some-card"


def test_a_signal_that_comes_while_a_stage_starts_cuts_it_off(tmp_path):
    """The log names the stage before its process starts: a SIGTERM then (what the test above sends as soon as it
    reads that line) stops the stage as one in flight, not after it ran to its end."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        signals = gpu_acceptance.Signals()
        signals.received = signal.SIGTERM
        stage = gpu_acceptance.BY_NAME["suite"]
        with (tmp_path / "log").open("a") as log:
            _, wall, status, why = gpu_acceptance.run_stage(stage, 600, True, log, tmp_path, signals)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert status == "cut off" and why.startswith("cut off by SIGTERM") and wall < 60
    assert not signals.waiting  # a later signal is noted, not raised in the driver's own code


def test_the_suite_stage_reads_pytests_summary_and_a_cut_off_runs_progress():
    summary = ["....", "=== 2 failed, 1048 passed, 13 skipped, 1 error in 280.1s ==="]
    assert suite_stages.pytest_counts(summary) == {"failed": 2, "passed": 1048, "skipped": 13, "error": 1}
    assert suite_stages.pytest_counts(["no summary"]) == {}
    cut = ["bringing up nodes...", "..s.F....E.   [ 10%]", "....x....s    [ 20%]", "..F"]
    counts, percent = suite_stages.pytest_progress(cut)
    assert counts == {"passed": 18, "failed": 2, "error": 1, "skipped": 2} and percent == 20
