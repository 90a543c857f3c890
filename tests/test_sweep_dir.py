"""A sweep dir is one experiment: a run in it is known by its config and seed, not by the place of its values in
today's command line. Run again in its sweep dir with a subset of the values, in another order or with one more
value, a sweep finds each run it has wherever its dir is and trains only the new ones; each run is in the table
once; the sweep's record keeps every command that added to it, and `normlab resume <sweep dir>` names them all. A
value of a key neither the sweep nor the command sweeps must be the sweep's, new jobs included."""

import hashlib
import json
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from cli_here import normlab_here
from conftest import one_error_line

COMMON = ["model=tiny", "batch_size=4", "seq_len=16", "max_steps=4", "eval_every=2", "eval_batches=2", "log_every=1",
          "progress=false", "wandb.mode=disabled"]
THREE = ["layer-pre-d2-lr1e-3-s0", "layer-pre-d2-lr3e-3-s0", "layer-pre-d2-lr1e-2-s0"]


def sweep(sweep_dir, *overrides, cwd):
    """`normlab train -m COMMON OVERRIDES hydra.sweep.dir=SWEEP_DIR`, an override of a COMMON key replacing it."""
    keys = {o.split("=", 1)[0] for o in overrides}
    common = [o for o in COMMON if o.split("=", 1)[0] not in keys]
    return normlab_here("train", "-m", *common, *overrides, f"hydra.sweep.dir={sweep_dir}", cwd=cwd)


def snapshot(path):
    """{relative path: sha256} of every file under `path`."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


def job_dirs(sweep_dir):
    return sorted(p.name for p in Path(sweep_dir).iterdir() if p.is_dir() and not p.name.startswith("."))


def trained(result):
    """The run names the command trained (their runs' last lines), in order."""
    return [line.split("] - ", 1)[1].split(" completed:")[0] for line in result.stdout.splitlines()
            if "[normlab][INFO]" in line and " completed: final val loss" in line]


def _recorded(tmp_path, num, lr, **kw):
    from normlab.config import run_identity
    from normlab.launch.sweep_index import RecordedRun

    flat = None if lr is None else {"lr": lr}
    return RecordedRun(tmp_path / f"{num}_r{lr}", num, flat, kw.get("given"), kw.get("ended", True),
                       None if flat is None else run_identity(flat))


def _asked(tmp_path, num, lr, overrides=()):
    from normlab.config import run_identity
    from normlab.launch.sweep_index import AskedJob

    return AskedJob(run_identity({"lr": lr}), list(overrides), num, tmp_path / f"{num}_r{lr}",
                    lambda n: tmp_path / f"{n}_r{lr}")


def test_a_job_lands_at_its_run_else_a_hole_of_its_place_else_after_the_sweeps_highest_number(tmp_path):
    from normlab.launch.sweep_index import Place, override_identity, place_jobs

    runs = [_recorded(tmp_path, n, float(n)) for n in (0, 2, 3)]
    runs.append(_recorded(tmp_path, 1, None, given=override_identity(["lr=0.5", "progress=false"]), ended=False))
    jobs = [_asked(tmp_path, 0, 3.0), _asked(tmp_path, 1, 0.5, ["lr=5e-1"]), _asked(tmp_path, 2, 8.0),
            _asked(tmp_path, 3, 0.0), _asked(tmp_path, 4, 9.0), _asked(tmp_path, 5, 7.0)]
    del runs[3]  # first without the dir that stopped before its config.json: job 1's place is a hole, job 5's not
    assert place_jobs(tmp_path, jobs, runs) == [Place(3, "3_r3.0"), Place(1, "1_r0.5"), Place(4, "4_r8.0"),
                                                Place(0, "0_r0.0"), Place(5, "5_r9.0"), Place(6, "6_r7.0")]
    runs.append(_recorded(tmp_path, 1, None, given=override_identity(["lr=0.5", "progress=false"]), ended=False))
    assert place_jobs(tmp_path, jobs, runs)[1] == Place(1, "1_rNone")  # known by its saved overrides, bookkeeping aside


@pytest.fixture(scope="module")
def three_lrs(tmp_path_factory):
    """A sweep of three lrs, each run to its end, made once; tests take copies."""
    root = tmp_path_factory.mktemp("three_lrs")
    result = sweep(root / "sweep", "lr=1e-3,3e-3,1e-2", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert job_dirs(root / "sweep") == [f"{n}_{name}" for n, name in enumerate(THREE)]
    return root / "sweep"


@pytest.fixture
def sweep_copy(three_lrs, tmp_path):
    shutil.copytree(three_lrs, tmp_path / "sweep")
    return tmp_path / "sweep"


def test_a_subset_another_order_and_one_more_value_train_only_the_new_run(sweep_copy, tmp_path):
    before = {name: snapshot(sweep_copy / name) for name in job_dirs(sweep_copy)}
    for values in ("lr=1e-2", "lr=3e-3,1e-3"):  # the last job alone (job 0 of this command), then two in reverse
        again = sweep(sweep_copy, values, cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert trained(again) == [] and again.stderr.count("already completed") == values.count(",") + 1
        assert {name: snapshot(sweep_copy / name) for name in job_dirs(sweep_copy)} == before  # byte for byte
        assert "sweep: 3 jobs (3 completed)" in again.stdout
    grown = sweep(sweep_copy, "lr=3e-2,1e-3", cwd=tmp_path)  # a new value first: numbered after the sweep's jobs
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert trained(grown) == ["layer-pre-d2-lr3e-2-s0"]
    assert job_dirs(sweep_copy) == [*before, "3_layer-pre-d2-lr3e-2-s0"]
    assert "job 3 layer-pre-d2-lr3e-2-s0: completed" in grown.stdout and "sweep: 4 jobs (4 completed)" in grown.stdout
    listed = normlab_here("ls", str(sweep_copy), cwd=tmp_path)
    runs = [line for line in listed.stdout.splitlines() if line.startswith("completed")]
    assert len(runs) == 4 and all(sum(name in line for line in runs) == 1 for name in job_dirs(sweep_copy))


def test_jobs_run_again_in_worker_processes_land_where_their_runs_are(sweep_copy, tmp_path):
    before = {name: snapshot(sweep_copy / name) for name in job_dirs(sweep_copy)}
    again = sweep(sweep_copy, "lr=3e-2,1e-2,1e-3", "hydra.launcher.cpu_jobs=2", cwd=tmp_path)  # two at once
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already completed") == 2 and "job 3 layer-pre-d2-lr3e-2-s0: completed" in again.stdout
    assert job_dirs(sweep_copy) == [*before, "3_layer-pre-d2-lr3e-2-s0"]
    assert {name: snapshot(sweep_copy / name) for name in before} == before


def test_the_sweeps_record_keeps_every_command_and_resume_continues_them_all(sweep_copy, tmp_path):
    again = sweep(sweep_copy, "lr=1e-2", "overwrite=true", cwd=tmp_path)  # job 2 afresh, in its own dir
    assert again.returncode == 0, again.stderr[-3000:]
    assert trained(again) == ["layer-pre-d2-lr1e-2-s0"] and job_dirs(sweep_copy) == [f"{n}_{name}" for n, name in enumerate(THREE)]
    assert sweep(sweep_copy, "lr=3e-2", cwd=tmp_path).returncode == 0
    record = yaml.safe_load((sweep_copy / "sweep.yaml").read_text())
    assert [c["overrides"][-1] for c in record["commands"]] == ["lr=1e-3,3e-3,1e-2", "overwrite=true", "lr=3e-2"]

    told = normlab_here("resume", str(sweep_copy), cwd=tmp_path)
    assert told.returncode == 2
    line = one_error_line(told.stderr, "a sweep dir", "lr=1e-3,3e-3,1e-2,3e-2", f"hydra.sweep.dir={sweep_copy}")
    assert "overwrite" not in line
    command = shlex.split(line.split("continue its jobs: ", 1)[1])
    assert command[:3] == ["normlab", "train", "-m"]
    pasted = normlab_here(*command[1:], cwd=tmp_path)  # every job of the grid, none trained again
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert trained(pasted) == [] and pasted.stderr.count("already completed") == 4 and len(job_dirs(sweep_copy)) == 4


def test_resume_names_each_command_whose_jobs_no_one_command_holds(tmp_path):
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    commands = [(["norm=rms,layer", "lr=1e-3"], []), (["norm=rms", "lr=3e-3", "overwrite=true"], ["hydra.launcher.cpu_jobs=2"]),
                (["norm=layer", "lr=1e-3", "ckpt.keep=2"], [])]  # the last one's jobs are the first one's
    (sweep_dir / "sweep.yaml").write_text(yaml.safe_dump({"commands": [
        {"overrides": o, "hydra": h, "config_dir": None, "config_name": None} for o, h in commands]}))
    told = normlab_here("resume", str(sweep_dir), cwd=tmp_path)
    assert told.returncode == 2
    one_error_line(told.stderr, f"normlab train -m norm=rms,layer lr=1e-3 ckpt.keep=2 hydra.sweep.dir={sweep_dir} && "
                   f"normlab train -m hydra.launcher.cpu_jobs=2 norm=rms lr=3e-3 hydra.sweep.dir={sweep_dir}")


def test_a_packed_sweep_run_again_with_one_more_seed_trains_only_the_new_members(tmp_path):
    first = sweep(tmp_path / "sweep", "pack=true", "lr=1e-3,3e-3", "seed=0,1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    ran = {name: json.loads((tmp_path / "sweep" / name / "summary.json").read_text()) for name in job_dirs(tmp_path / "sweep")}
    again = sweep(tmp_path / "sweep", "pack=true", "lr=1e-3,3e-3", "seed=0,1,2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(trained(again)) == ["layer-pre-d2-lr1e-3-s2", "layer-pre-d2-lr3e-3-s2"]
    assert job_dirs(tmp_path / "sweep") == sorted([*ran, "4_layer-pre-d2-lr1e-3-s2", "5_layer-pre-d2-lr3e-3-s2"])
    for name, summary in ran.items():  # the finished members' records as they were
        assert json.loads((tmp_path / "sweep" / name / "summary.json").read_text()) == summary


@pytest.mark.parametrize("change, was, now", [
    (["max_steps=6", "lr=3e-2"], "max_steps=4", "max_steps=6"),  # a new job alone
    (["depth=3", "lr=1e-3,3e-3"], "depth=2", "depth=3"),
], ids=["max_steps", "depth"])
def test_a_value_the_sweep_does_not_sweep_is_refused_for_new_jobs_too(sweep_copy, tmp_path, change, was, now):
    before = snapshot(sweep_copy)
    again = sweep(sweep_copy, *change, cwd=tmp_path)
    assert again.returncode == 2
    one_error_line(again.stderr, f"hydra.sweep.dir={sweep_copy}", f"ran with {was}", f"this command gives {now}")
    assert snapshot(sweep_copy) == before


def test_a_key_the_command_sweeps_may_take_a_new_value_beside_the_sweeps(sweep_copy, tmp_path):
    again = sweep(sweep_copy, "depth=2,3", "lr=1e-2", cwd=tmp_path)  # depth 2 is the sweep's: found, not trained again
    assert again.returncode == 0, again.stderr[-3000:]
    assert trained(again) == ["layer-pre-d3-lr1e-2-s0"] and "3_layer-pre-d3-lr1e-2-s0" in job_dirs(sweep_copy)


def test_another_launcher_that_would_train_a_run_again_is_refused(sweep_copy, tmp_path):
    before = snapshot(sweep_copy)
    again = sweep(sweep_copy, "lr=1e-2", "hydra/launcher=basic", cwd=tmp_path)
    assert again.returncode == 2
    one_error_line(again.stderr, "hydra/launcher=basic", "job 0 (layer-pre-d2-lr1e-2-s0)", "2_layer-pre-d2-lr1e-2-s0")
    assert snapshot(sweep_copy) == before
