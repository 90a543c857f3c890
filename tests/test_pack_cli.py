"""pack=true through the real `normlab train -m`: the jobs that differ only in lr and seed train as one
packed model, and every member is an ordinary Hydra job and an ordinary run (dir, rows, summary, wandb run,
sweep table, compare); jobs that differ in anything else form separate packs; what cannot pack is refused."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import tiny_config
from normlab.cli import main
from normlab.config import ConfigError
from normlab.config.packing import check_packable, pack_groups
from cli_here import normlab_here
from test_cli import run_dirs

TINY = ["model=tiny", "max_steps=4", "eval_every=2", "eval_batches=1", "batch_size=4", "seq_len=16", "log_every=1",
        "telemetry.every=0", "device=cpu"]
LR_SEED = ["lr=1e-3,3e-3", "seed=0,1"]
COMPARED = ("loss", "grad_norm", "val_loss")


def _runs(sweep_dir):
    """{run name: run dir} of a sweep's jobs."""
    return {d.name.split("_", 1)[1]: d for d in run_dirs(sweep_dir)}


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _assert_same_rows(packed, unpacked):
    rows, expected = _rows(packed), _rows(unpacked)
    assert [r["step"] for r in rows] == [r["step"] for r in expected]
    for row, want in zip(rows, expected):
        assert row.keys() == want.keys(), row["step"]
        for key in COMPARED:
            if key in want:
                assert row[key] == pytest.approx(want[key], rel=1e-5, abs=0), (packed.name, row["step"], key)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """The same lr × seed sweep of model=tiny, unpacked and with pack=true, in one cwd, through the command in
    this process. The unpacked sweep, the reference, needs no wandb runs (about two seconds a job)."""
    cwd = tmp_path_factory.mktemp("pack-sweeps")
    env = {"NORMLAB_CACHE": os.environ.get("NORMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))}
    unpacked = normlab_here("train", "-m", *TINY, *LR_SEED, "wandb.mode=disabled", "hydra.sweep.dir=unpacked", cwd=cwd,
                            env=env)
    assert unpacked.returncode == 0, unpacked.stderr[-3000:]
    packed = normlab_here("train", "-m", *TINY, *LR_SEED, "pack=true", "hydra.sweep.dir=packed", cwd=cwd, env=env)
    assert packed.returncode == 0, packed.stderr[-3000:]
    return cwd, env, packed


def test_a_packed_lr_seed_sweep_writes_the_unpacked_sweeps_runs(sweeps):
    cwd, _, packed = sweeps
    runs, unpacked = _runs(cwd / "packed"), _runs(cwd / "unpacked")
    assert sorted(runs) == sorted(unpacked) and len(runs) == 4
    assert (packed.stdout + packed.stderr).count("[pack of 4]") == 4  # the launcher's line per job
    for name, run_dir in runs.items():
        _assert_same_rows(run_dir, unpacked[name])
        summary, expected = _summary(run_dir), _summary(unpacked[name])
        assert summary["status"] == "completed" and summary["name"] == name
        assert summary["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-5)
        assert (summary["group"], expected["group"]) == ("lr+seed_packed", "lr+seed_unpacked")  # wandb's group: the sweep
        config, unpacked_config = (json.loads((d / "config.json").read_text()) for d in (run_dir, unpacked[name]))
        assert config.pop("wandb")["overrides"][-1] == "pack=True"
        unpacked_config.pop("wandb")
        assert config == {**unpacked_config, "pack": True}
        assert {p.name for p in (run_dir / ".hydra").iterdir()} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
        assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
        # The pack's log is in every member's job log: its start and each member's end.
        job_log = (run_dir / "normlab.log").read_text()
        assert "pack of 4 jobs (#0, #1, #2, #3) trains as one packed model" in job_log
        assert all(f"{other} completed: final val loss" in job_log for other in runs)


def test_the_packed_sweep_reports_every_job_and_compares_as_an_unpacked_one(sweeps):
    cwd, env, packed = sweeps
    runs = _runs(cwd / "packed")
    for name, run_dir in runs.items():
        assert f"job {run_dir.name.split('_')[0]} {name}: completed, final val loss" in packed.stdout
    table = packed.stdout[packed.stdout.index("sweep: 4 jobs (4 completed), best first"):]
    assert sorted(line.split()[1] for line in table.splitlines()[2:6]) == sorted(runs)
    assert "next: normlab compare packed" in table
    reports = {}
    for sweep in ("packed", "unpacked"):
        done = normlab_here("compare", sweep, cwd=cwd, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        reports[sweep] = (cwd / sweep / "report" / "report.md").read_text()
    assert "4 runs in 1 arm" in reports["packed"] and "4 runs in 1 arm" in reports["unpacked"]
    for report in reports.values():
        assert "| layer-pre | 1e-3, 3e-3 |" in report and "0 of 4 |" in report


def test_a_rerun_packed_sweep_trains_nothing_again(sweeps, tmp_path):
    cwd, env, _ = sweeps
    shutil.copytree(cwd / "packed", tmp_path / "again", ignore=shutil.ignore_patterns("report"))
    before = {name: sorted((d / "wandb").glob("offline-run-*")) for name, d in _runs(tmp_path / "again").items()}
    again = normlab_here("train", "-m", *TINY, *LR_SEED, "pack=true", "hydra.sweep.dir=again", cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already completed") == 4
    assert "trains as one packed model" not in again.stdout + again.stderr
    assert "sweep: 4 jobs (4 completed), best first" in again.stdout
    assert {name: sorted((d / "wandb").glob("offline-run-*")) for name, d in _runs(tmp_path / "again").items()} == before


def test_jobs_that_differ_in_the_norm_form_separate_packs_in_their_worker_slots(sweeps, tmp_path):
    cwd, env, _ = sweeps
    # CUDA_VISIBLE_DEVICES="": the CPU's slots (cpu_jobs), as on a machine without a GPU. No wandb runs: a worker
    # would import wandb for them (seconds); a sweep's wandb runs in workers are test_launcher's, a pack's the fixture's.
    result = normlab_here("train", "-m", *TINY, "norm=layer,rms", "lr=1e-3,3e-3", "pack=true", "wandb.mode=disabled",
                          "hydra.launcher.cpu_jobs=2", "hydra.sweep.dir=sweep", cwd=tmp_path,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Launching 4 jobs (2 packs among them), 2 at once on the CPU" in result.stdout + result.stderr
    runs = _runs(tmp_path / "sweep")
    assert sorted(runs) == ["layer-pre-d2-lr1e-3-s0", "layer-pre-d2-lr3e-3-s0", "rms-pre-d2-lr1e-3-s0", "rms-pre-d2-lr3e-3-s0"]
    for name, run_dir in runs.items():
        assert _summary(run_dir)["status"] == "completed"
        norm = name.split("-")[0]
        job_log = (run_dir / "normlab.log").read_text()
        first = "#0, #1" if norm == "layer" else "#2, #3"
        assert f"pack of 2 jobs ({first}) trains as one packed model" in job_log
        assert all((f"{other} completed" in job_log) == other.startswith(norm + "-") for other in runs)
    unpacked = _runs(cwd / "unpacked")  # the same configs, seed 0, trained unpacked
    for name in ("layer-pre-d2-lr1e-3-s0", "layer-pre-d2-lr3e-3-s0"):
        _assert_same_rows(runs[name], unpacked[name])


def test_a_failing_pack_fails_each_of_its_jobs_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "small.txt").write_text("too small")
    result = normlab_here("train", "-m", *TINY, "lr=1e-3,3e-3", "pack=true", "data=text",
                          f"data.files=[{tmp_path / 'small.txt'}]", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = _runs(tmp_path / "sweep")
    assert len(runs) == 2
    for run_dir in runs.values():
        summary = _summary(run_dir)
        assert summary["status"] == "failed" and "small.txt" in summary["error"]
        assert "Traceback (most recent call last)" in (run_dir / "normlab.log").read_text()  # as a failed job's log
    failures = [line for line in result.stderr.splitlines() if line.startswith("normlab: error:")]
    assert len(failures) == 2 and "job 0" in failures[0] and "job 1" in failures[1]
    assert "sweep: 2 jobs (2 failed), best first" in result.stdout


def test_a_preempted_pack_resumes_when_its_sweep_runs_again(tmp_path):
    sweep = ["train", "-m", *TINY, "max_steps=200", "eval_every=100", "ckpt.every=1000", "progress=false",
             "wandb.mode=disabled", "lr=1e-3,3e-3", "pack=true", "hydra.sweep.dir=sweep"]
    proc = subprocess.Popen([sys.executable, "-m", "normlab", *sweep], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = tmp_path / "sweep" / "0_layer-pre-d2-lr1e-3-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (first.exists() and len(first.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "normlab: pack of layer-pre-d2-lr1e-3-s0, layer-pre-d2-lr3e-3-s0 preempted" in err
    runs = _runs(tmp_path / "sweep")
    [step] = {_summary(d)["preempted_step"] for d in runs.values()}
    assert all(_summary(d)["status"] == "preempted" for d in runs.values())
    again = normlab_here(*sweep, cwd=tmp_path)  # the rerun is no process's signal: in this process
    assert again.returncode == 0, again.stderr[-3000:]
    for run_dir in runs.values():
        summary = _summary(run_dir)
        assert summary["status"] == "completed" and summary["resumed_from_step"] == step
        assert [r["step"] for r in _rows(run_dir)] == list(range(201))
    assert "sweep: 2 jobs (2 completed), best first" in again.stdout


def _installed(plugin: str) -> bool:
    return importlib.util.find_spec(f"hydra_plugins.{plugin}") is not None


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["-m", "hydra/launcher=basic"], {}, "pack=true with hydra/launcher=basic: only normlab's launcher"),
        pytest.param(["-m", "hydra/launcher=joblib"], {}, "pack=true with hydra/launcher=joblib: only normlab's launcher",
                     marks=pytest.mark.skipif(not _installed("hydra_joblib_launcher"), reason="needs joblib's launcher")),
        pytest.param(["-m", "hydra/launcher=slurm"], {}, "pack=true with hydra/launcher=slurm: only normlab's launcher",
                     marks=pytest.mark.skipif(not _installed("hydra_submitit_launcher"), reason="needs submitit's launcher")),
        pytest.param(["-m", "hydra/sweeper=lr_search"], {}, "pack=true with hydra/sweeper=lr_search: only a grid sweep",
                     marks=pytest.mark.skipif(not _installed("hydra_optuna_sweeper"), reason="needs Optuna's sweeper")),
        (["-m", "compile=true"], {}, "pack=true with compile=true:"),
        (["-m", "precision=fp16"], {}, "pack=true with precision=fp16:"),
        (["-m"], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "pack=true under torchrun:"),
        ([], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "pack=true under torchrun:"),
        (["-m", "pack=yes"], {}, "pack='yes': must be true or false"),
    ],
)
def test_what_cannot_pack_is_refused_in_one_line_before_anything_is_written(tmp_path, args, env, message, monkeypatch,
                                                                            capsys):
    # Through normlab.cli.main in this process (what `python -m normlab` calls): a refusal before any job needs no
    # subprocess, whose start-up (torch's import) costs seconds of CPU.
    pack = [] if "pack=yes" in args else ["pack=true"]
    lrs = ["lr=1e-3,3e-3"] if "-m" in args else []
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert main(["train", *args, *TINY, *lrs, *pack]) == 2, capsys.readouterr().err[-3000:]
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"normlab: error: {message}"), line
    assert not (tmp_path / "outputs").exists()


def test_pack_groups_pack_the_jobs_that_differ_only_in_lr_and_seed():
    cfgs = [
        tiny_config("layer", lr=1e-3, pack=True),
        tiny_config("rms", lr=1e-3, pack=True),
        tiny_config("layer", lr=3e-3, seed=1, pack=True, progress=True),  # progress is bookkeeping
        tiny_config("layer", lr=1e-3, pack=False),  # asks for no pack: alone
        None,  # a job whose config could not be built: alone
        tiny_config("rms", lr=3e-3, pack=True),
        tiny_config("layer", lr=3e-3, depth=3, pack=True),
    ]
    assert pack_groups(cfgs) == [[0, 2], [1, 5], [3], [4], [6]]
    assert pack_groups([tiny_config("layer"), tiny_config("layer", lr=3e-3)]) == [[0], [1]]


@pytest.mark.parametrize("key, value", [("device", "auto"), ("compile", True), ("tf32", False), ("deterministic", True),
                                        ("log_every", 3), ("telemetry.every", 2), ("ckpt.every", 1)])
def test_jobs_that_differ_in_what_a_pack_takes_from_its_first_member_train_in_separate_packs(key, value):
    """A pack computes, measures, logs and saves as its first member says (normlab.train.pack): a job that says
    otherwise trains in a pack of its own, not silently as the first one says."""
    other = tiny_config("layer", lr=3e-3, pack=True)
    section, _, name = key.rpartition(".")
    setattr(getattr(other, section) if section else other, name, value)
    cfgs = [tiny_config("layer", lr=1e-3, pack=True), other, tiny_config("layer", lr=1e-2, pack=True)]
    assert pack_groups(cfgs) == [[0, 2], [1]]
    with pytest.raises(ConfigError, match=f"differ in {key} "):
        check_packable(cfgs[:2])


def test_jobs_that_differ_only_in_what_each_member_keeps_its_own_of_pack_together():
    cfgs = [tiny_config("layer", lr=1e-3, pack=True), tiny_config("layer", lr=3e-3, pack=True, name="mine")]
    cfgs[1].wandb.tags = ["other"]
    assert pack_groups(cfgs) == [[0, 1]]


@pytest.mark.parametrize("device, precision, gpu_possible, asked", [
    ("auto", "auto", True, True),  # may train on CUDA, whose bf16 support decides fp16: torch is asked
    ("cuda", "auto", False, True),
    ("auto", "auto", False, False),  # no GPU can be here: the CPU's auto precision is fp32
    ("cpu", "auto", True, False),
    ("auto", "bf16", True, False),  # a precision named, not resolved
])
def test_the_launchers_pack_check_asks_torch_only_where_the_device_decides_the_precision(
        monkeypatch, device, precision, gpu_possible, asked):
    import normlab.launch.machine as machine
    import normlab.launch.prechecks as prechecks
    import normlab.train.pack as pack

    seen = []
    monkeypatch.setattr(pack, "check_pack", lambda cfgs: seen.append([cfg.seed for cfg in cfgs]))
    monkeypatch.setattr(machine, "gpu_impossible", lambda: not gpu_possible)
    cfgs = [tiny_config(device=device, precision=precision, pack=True, seed=seed) for seed in (0, 1)]
    prechecks.check_packing(cfgs, {})
    assert seen == ([[0, 1]] if asked else [])


def test_the_launchers_pack_check_names_the_first_pack_it_refuses(monkeypatch):
    """Pack by pack, in the sweep's order, as normlab.train.pack.check_pack refused them: the first pack's precision,
    which its device resolves (here: fp16, a CUDA device without bf16), before a later pack's compile=true."""
    import normlab.launch.prechecks as prechecks
    import normlab.train.pack as pack
    from normlab.config import ConfigError

    def fp16(cfgs):
        raise ConfigError(f"pack=true with precision=fp16 (device={cfgs[0].device})")

    monkeypatch.setattr(pack, "check_pack", fp16)
    cuda = [tiny_config(device="cuda", precision="auto", pack=True, seed=seed) for seed in (0, 1)]
    compiled = [tiny_config("rms", compile=True, pack=True, seed=seed) for seed in (0, 1)]  # another pack
    assert pack_groups(cuda + compiled) == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="precision=fp16"):
        prechecks.check_packing(cuda + compiled, {})
