"""Hydra's sweep grammar through the real `normlab train -m`: glob, range, Optuna's interval, presets
without '+', and a bad value inside a sweep refused before any job trains. All through normlab.cli.main in this
process, what `python -m normlab` calls: the grammar needs no process of its own."""

import json

import pytest

from normlab.cli import main
from cli_here import normlab_here
from test_cli import TINY, run_dirs


# What these sweeps check is Hydra's grammar, not wandb: a wandb run costs each job about two seconds.
SWEEP = [*TINY, "wandb.mode=disabled"]


def _runs(root):
    return sorted(json.loads((d / "summary.json").read_text())["name"] for d in run_dirs(root))


def test_glob_with_exclude_and_range_sweep(tmp_path):
    result = normlab_here(
        "train", "-m", "norm=glob(*,exclude=[batch*,none,layer*,l2,d*,scale,rms_noweight])", "seed=range(1,3)",
        *SWEEP, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _runs(tmp_path / "outputs") == ["rms-pre-d2-lr3e-3-s1", "rms-pre-d2-lr3e-3-s2"]


def test_optuna_interval_sweep_with_two_trials(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    result = normlab_here(
        "train", "-m", "hydra/sweeper=lr_search", "lr=tag(log,interval(1e-4,1e-1))", "hydra.sweeper.n_trials=2",
        *SWEEP, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs(tmp_path / "outputs")]
    assert len(summaries) == 2 and all(s["status"] == "completed" for s in summaries)
    assert all(1e-4 <= s["lr"] <= 1e-1 for s in summaries) and summaries[0]["lr"] != summaries[1]["lr"]
    best = min(s["final_val_loss"] for s in summaries)
    assert f"Best value: {best}" in result.stdout + result.stderr


def _preset(tmp_path, sweep: str) -> None:
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "pair.yaml").write_text(
        "# @package _global_\nlr: 1e-3\nhydra:\n  sweeper:\n    params:\n" + sweep
    )


def test_experiment_preset_without_plus(tmp_path):
    _preset(tmp_path, "      norm: layer,rms\n")
    result = normlab_here("train", "-m", "--config-dir", "conf", "experiment=pair", *SWEEP, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _runs(tmp_path / "outputs") == ["layer-pre-d2-lr1e-3-s0", "rms-pre-d2-lr1e-3-s0"]


def test_experiment_preset_with_plus_is_the_same_preset(tmp_path, monkeypatch, capsys):
    _preset(tmp_path, "      placement: pre,middle\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", "--config-dir", "conf", "+experiment=pair", *TINY]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("normlab: error: placement='middle' is not allowed")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "sweep, message",
    [
        # glob expands to every norm, none among them: a job the sweeper makes is refused, named by its
        # number and the override that tells it from the others (placement=deepnorm is every job's).
        (["norm=glob(*,exclude=batch*)", "placement=deepnorm"], "(in the sweep's job 6 of jobs 0-9: norm=none)"),
        (["seq_len=16,512"], "seq_len=512 is larger than the model's context"),
        (["lr=interval(1e-4,1e-1)"], "lr=interval(1e-4,1e-1): BasicSweeper does not support sweep type"),
    ],
)
def test_a_bad_job_in_a_sweep_stops_it_before_any_job_trains(tmp_path, monkeypatch, capsys, sweep, message):
    tiny = [o for o in TINY if not o.startswith("seq_len=")]
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", *tiny, *sweep]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("normlab: error: ") and message in line
    assert not (tmp_path / "outputs").exists()


@pytest.fixture
def composed(monkeypatch):
    """The overrides of every config Hydra composes from here on, in order."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    seen = []
    load = ConfigLoaderImpl.load_configuration

    def counting(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        seen.append(list(overrides))
        return load(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
    return seen


def test_the_checks_before_a_sweep_compose_each_shape_of_job_once(tmp_path, monkeypatch, capsys, composed):
    """check_composition and check_jobs share their compositions, and jobs that differ from an earlier one only in
    values are derived from it (normlab.launch.derived): Hydra's composition costs a job 0.1 s."""
    monkeypatch.chdir(tmp_path)
    # The last job is bad: the checks refuse the sweep, so only they compose (Hydra never starts).
    assert main(["train", "-m", *TINY, "seed=0,1,2", "placement=pre,deepnorm", "norm=none"]) == 2
    assert "placement=deepnorm with norm=none" in capsys.readouterr().err
    jobs = [job for job in composed if any(o.startswith("seed=") and "," not in o for o in job)]
    assert len(jobs) == 1  # seed and placement are values: one shape of job for the six


def test_a_sweep_composes_each_shape_of_job_once_in_the_checks_and_once_in_hydra(tmp_path, monkeypatch, composed):
    """Hydra's sweeper composes each job to validate it and its launcher again to run it; normlab's
    launcher runs the job with the config the validation composed (same results, 0.1 s less a job), and both
    derive a job that differs from an earlier one only in values from that one's config."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # jobs in this process, one after another, also beside a GPU
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", *SWEEP, "seed=0,1,2", "norm=layer,rms"]) == 0
    per_job = [sum(f"seed={s}" in job and f"norm={n}" in job for job in composed) for n in ("layer", "rms") for s in range(3)]
    assert per_job == [2, 0, 0, 2, 0, 0]  # normlab's checks, then Hydra's validation; the launcher reuses the latter
    summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs(tmp_path / "outputs")]
    assert sorted(s["seed"] for s in summaries) == [0, 0, 1, 1, 2, 2] and all(s["status"] == "completed" for s in summaries)
