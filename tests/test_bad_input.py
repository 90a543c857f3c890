"""Bad input to the real `normlab train` command: one `normlab: error:` line naming what is wrong and
what is allowed, exit code 2, no traceback, nothing trained.

The cases go through `normlab.cli.main`, the function `python -m normlab` calls, in this process
(test_cli.normlab_here): a subprocess per case cost seconds of start-up each. test_the_real_command_gives_the_same_one_line runs a
few of them as the real command, exit status and all."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

from normlab.config import ConfigError, RunConfig, suggest_key, unknown_key_message
from normlab.launch import machine
from normlab.launch.machine import MemoryEstimate, check_memory, check_output_dir, estimate_memory
from cli_here import normlab_here


def _installed(module: str) -> bool:
    """Whether a Hydra plugin is installed: a missing one is what its bad-input case needs."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False

TINY = ["model=tiny", "max_steps=1", "eval_batches=1", "batch_size=4", "seq_len=16", "progress=false", "wandb.mode=disabled"]


def normlab(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "normlab", *args], cwd=cwd, capture_output=True, text=True, env=dict(os.environ), timeout=300
    )


def assert_one_line(result, *fragments):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: "), result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def trained(cwd) -> list:
    return [p for p in cwd.rglob("metrics.jsonl") if "wandb" not in p.parts] + list(cwd.rglob("summary.json"))


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        # key typos, with the key they meant (Hydra: several lines, exit 1)
        (["nrom=rms"], ["nrom is not a config key", "did you mean norm=rms?"]),
        (["lr_rate=1"], ["did you mean lr=1?"]),
        (["model.dmodel=64"], ["did you mean model.d_model=64?"]),
        (["experment=norm_grid"], ["did you mean experiment=norm_grid?"]),
        (["-m", "nrom=rms,layer"], ["did you mean norm="]),
        # unknown keys added with + (Hydra: accepted silently)
        (["+nrom=rms"], ["did you mean norm=rms?"]),
        (["+foo=bar"], ["foo is not a config key", "the top-level keys are: name, norm, placement"]),
        (["+model.zzz=1"], ["the keys under model are: d_model, n_head"]),
        (["+lr=1e-3"], ["lr is already in the config", "write lr=1e-3 (without +)"]),
        # a key the chosen group option does not have
        (["data.files=[a.txt]"], ["data.files is set, but data=stdlib does not read it", "add data=text"]),
        (["+data.files=[a.txt]"], ["data.files is set, but data=stdlib does not read it", "add data=text"]),
        (["norm=rms", "norm.momentum=0.5"], ["norm=rms has no knob 'momentum'", "(norm=batch read it)"]),
        (["tokenizer.name=gpt2"], ["tokenizer.name is set, but tokenizer=byte does not read it", "add tokenizer=hf"]),
        (["tokenizer.vocab_size=1000"], ["tokenizer.vocab_size is set, but tokenizer=byte does not read it", "tokenizer=bpe"]),
        (["data.split=test"], ["data.split is set, but data=stdlib does not read it", "add data=hf"]),
        # a mapping or list where a group's option or a single value goes (Hydra: a TypeError, or its merge error)
        (["norm={a: 1}"], ["norm={a:1}: norm is a config group: give the name of one of its options (batch, ",
                           "not a mapping; to set norm.a, write norm.a=1"]),
        (["model=[tiny]"], ["model=[tiny]: model is a config group", "options (", "tiny", "not a list"]),
        (["wandb.tags={a: 1}"], ["wandb.tags={a: 1}: wandb.tags takes a list ([a,b]), not a mapping"]),
        (["optim.betas={a: 1}"], ["optim.betas={a: 1}: optim.betas takes a list ([a,b]), not a mapping"]),
        (["hydra.run.dir={a: 1}"], ["hydra.run.dir={a: 1}: hydra.run.dir cannot take a mapping: Cannot convert 'dict' to string"]),
        (["seed={a: 1}"], ["seed={'a': 1}: must be an integer"]),
        # the command line's shape
        (["lr=1e-3,3e-3"], ["lr=1e-3,3e-3 is a sweep", "add -m"]),
        (["norm=rms,layer"], ["is a sweep", "add -m"]),
        (["lr=[1e-3"], ["not an override normlab can read", "key=value"]),
        (["name=a^b"], ["name=a^b: not an override normlab can read ('^' at position 1 of the value cannot stand "
                        "unquoted: quote it as name='a^b', in a shell \"name='a^b'\")"]),
        (["name=" + "x" * 5000], ["name='xxxxxxxx", "…[4942 characters]…", "': a run name has 1 to 100 characters"]),
        # a character no path or name holds (Hydra: its grammar's error over two lines, blaming what follows)
        (["hydra.run.dir=run\nb"], ["hydra.run.dir holds a newline (\\n) at position 3 of its value 'run\\nb'",
                                     "may hold neither control characters nor bytes that are not UTF-8"]),
        (["name=a\tb"], ["name holds a tab (\\t) at position 1"]),
        (["hydra.run.dir=run\udcff"], ["hydra.run.dir holds the byte 0xff, which is not UTF-8, at position 3"]),
        (["--config-dir", "no/such/dir"], ["--config-dir=no/such/dir: no such directory"]),
        (["--config-name", "nope"], ["--config-name=nope: no such config", "config"]),
        (["lr=1e-3", "-m", "norm=rms,layer"], ["unrecognized arguments", "put -m and other options before the overrides"]),
        pytest.param(["-m", "hydra/launcher=joblib", "lr=1e-3,3e-3"], ['pip install "normlab[joblib]"'],
                     marks=pytest.mark.skipif(_installed("hydra_plugins.hydra_joblib_launcher"), reason="installed here")),
        pytest.param(["-m", "hydra/sweeper=lr_search"], ['pip install "normlab[optuna]"'],
                     marks=pytest.mark.skipif(_installed("hydra_plugins.hydra_optuna_sweeper"), reason="installed here")),
        (["-m", "hydra/launcher=nope", "lr=1e-3"], ["hydra/launcher=nope is not a known option", "basic"]),
        # values normlab did not check
        (["seed=-1"], ["seed=-1", "between 0 and 2**32-1"]),
        (["seed=4294967296"], ["seed=4294967296"]),
        (["optim.betas=[0.9]"], ["optim.betas=[0.9]", "two numbers in [0, 1)"]),
        (["optim.betas=[0.9,1.0]"], ["two numbers in [0, 1)"]),
        (["optim.eps=-1e-8"], ["optim.eps=", "must be >= 0"]),
        (["optim.grad_clip=nan"], ["optim.grad_clip=nan", "finite"]),
        (["diverge_factor=nan"], ["diverge_factor=nan", "finite"]),
        (["optim.weight_decay=nan"], ["optim.weight_decay=nan", "finite"]),
        (["lr=inf"], ["lr=inf"]),
        (["model.vocab_size=100"], ["model.vocab_size=100 is smaller than the tokenizer's vocabulary (256 ids"]),
        (["tokenizer=bpe", "tokenizer.vocab_size=1000", "model.vocab_size=512"], ["(1000 ids, tokenizer=bpe)"]),
        (["wandb.project=team/normlab"], ["wandb.project='team/normlab'", "none of / \\ # ? % :"]),
        (["wandb.project=" + "p" * 129], ["1 to 128 characters"]),
        (["wandb.tags=[" + "t" * 65 + "]"], ["a wandb tag is a string of 1 to 64 characters"]),
        # a value that reads the hydra node, which the job runs without; a missing value
        (["-m", "wandb.group=${hydra.runtime.choices.norm}", "seed=0,1"],
         ["Interpolation key 'hydra.runtime.choices.norm' not found"]),
        (["seed=???"], ["seed='???': must be an integer"]),
        # what only this machine can refuse
        (["depth=1000000"], ["needs about", "GiB", "of physical memory on this machine", "lower depth"]),
        (["hydra.run.dir=a_file"], ["a_file is a file, not a directory"]),
        (["hydra.run.dir=a_file/run"], ["a_file is a file, not a directory"]),
        (["hydra.run.dir=/proc/normlab-run"], ["cannot create the run dir there"]),
        (["hydra.run.dir=" + "r" * 300], ["hydra.run.dir=", "too long"]),
        (["-m", "hydra.sweep.dir=a_file", "lr=1e-3,3e-3"], ["hydra.sweep.dir=a_file", "not a directory"]),
        # normlab's launcher's settings (Hydra: a traceback, or accepted silently)
        (["-m", "hydra.launcher.jobs_per_gpu=0", "lr=1e-3,3e-3"], ["hydra.launcher.jobs_per_gpu=0: must be an integer >= 1"]),
        (["-m", "hydra.launcher.cpu_jobs=0", "lr=1e-3,3e-3"], ["hydra.launcher.cpu_jobs=0: must be an integer >= 1"]),
        (["-m", "hydra.launcher.cpu_jobs=abc", "lr=1e-3,3e-3"], ["hydra.launcher.cpu_jobs=abc: must be an integer >= 1"]),
        (["-m", "hydra.launcher.cpu_jobs=1.5", "lr=1e-3,3e-3"], ["hydra.launcher.cpu_jobs=1.5: must be an integer >= 1"]),
        (["-m", "hydra.launcher.mps=maybe", "lr=1e-3,3e-3"], ["hydra.launcher.mps=maybe: must be auto, true or false"]),
        (["-m", "hydra.launcher.devices=[-1]", "lr=1e-3,3e-3"], ["hydra.launcher.devices=[-1]: must be null (every visible GPU) or a list of GPU ids"]),
        pytest.param(["-m", "hydra.launcher.devices=[0,1]", "lr=1e-3,3e-3"],
                     ["hydra.launcher.devices=[0,1]: this machine has no GPU", "drop it"],
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ],
)
def test_bad_input_gives_one_line_and_trains_nothing(tmp_path, overrides, fragments):
    (tmp_path / "a_file").write_text("not a dir")
    result = normlab_here("train", *overrides, *TINY, cwd=tmp_path)
    assert_one_line(result, *fragments)
    assert not trained(tmp_path) and [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_a_refusal_echoes_a_long_value_cut_and_a_quoted_value_as_advised_is_read(tmp_path):
    long = normlab_here("train", "name=" + "x" * 5000, *TINY, cwd=tmp_path)
    assert len(assert_one_line(long)) < 300
    result = normlab_here("train", "name='a^b'", *TINY, "--cfg", "job", cwd=tmp_path)  # as the refusal of name=a^b says
    assert result.returncode == 0 and "name: a^b" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["lr=1e-3,-1,2e-3"], ["lr=-1: must be a positive number (in the sweep's job 1 of jobs 0-2: lr=-1)"]),
        (["norm=rms,layer", "lr=1e-3,-1"], ["(in the sweep's job 1 of jobs 0-3: norm=rms lr=-1, and 1 more job)"]),
        (["norm=rms,foo", "lr=1e-3,3e-3"], ["norm='foo' is not a known option", "(in the sweep's job 2 of jobs 0-3: norm=foo "]),
        (["lr=-1"], ["lr=-1: must be a positive number"]),  # in every job: no job to name
    ],
)
def test_a_sweeps_bad_value_names_its_job_and_nothing_is_written(tmp_path, overrides, fragments):
    """Jobs are numbered from 0 as the sweep's job dirs and lines are, and named by the overrides that tell them apart."""
    line = assert_one_line(normlab_here("train", "-m", *overrides, *TINY, cwd=tmp_path), *fragments)
    assert ("(in the sweep's job" in line) == (len(overrides) > 1 or "," in overrides[0])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["nrom=rms"], ["did you mean norm=rms?"]),  # refused before Hydra starts
        (["lr=1e-3", "-m", "norm=rms,layer"], ["put -m and other options before the overrides"]),  # by argparse
        (["hydra.run.dir=a_file/run"], ["a_file is a file, not a directory"]),  # by the run dir's check
    ],
)
def test_the_real_command_gives_the_same_one_line(tmp_path, overrides, fragments):
    (tmp_path / "a_file").write_text("not a dir")
    assert_one_line(normlab("train", *overrides, *TINY, cwd=tmp_path), *fragments)
    assert not trained(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(tmp_path):
    assert_one_line(normlab_here("train", "device=cuda", *TINY, cwd=tmp_path), "device=cuda", "no CUDA device", "device=cpu")


def test_a_huge_model_is_refused_before_it_allocates(tmp_path):
    start = time.monotonic()
    line = assert_one_line(normlab_here("train", "depth=1000000", cwd=tmp_path), "needs about")
    # Allocating it took a minute and ended in a 200-line MemoryError; refusing it takes the checks' time only.
    assert time.monotonic() - start < 60, line


def test_the_memory_estimate_counts_parameters_adamw_state_and_activations():
    cfg = RunConfig.from_dict({"depth": 2, "model": {"d_model": 32, "context": 64, "vocab_size": 256}, "seq_len": 16, "batch_size": 4})
    estimate = estimate_memory(cfg)
    # (256 + 64)·32 embedding rows, and per block 4·32² attention + 2·4·32² MLP weights
    assert estimate.params == 320 * 32 + 2 * 12 * 32 * 32
    assert estimate.persistent == 16 * estimate.params
    # 4·16 tokens × (2 blocks × (8 + 8)·32 values + 2·256 logits) × 4 bytes
    assert estimate.activations == 64 * (2 * 16 * 32 + 512) * 4
    deeper = RunConfig.from_dict({"depth": 4, "model": {"d_model": 32, "context": 64, "vocab_size": 256}, "seq_len": 16, "batch_size": 4})
    assert estimate_memory(deeper).total > estimate.total


def fixed_memory(monkeypatch, each_mib: int, available_mib: int):
    """Every run's estimate `each_mib`, and `available_mib` of physical memory."""
    monkeypatch.setattr(machine, "estimate_memory", lambda cfg, element_bytes=4: MemoryEstimate(10**6, (each_mib - 100) * 2**20, 100 * 2**20))
    monkeypatch.setattr(machine, "physical_memory", lambda: available_mib * 2**20)


def test_a_packs_members_need_their_memory_together(monkeypatch):
    fixed_memory(monkeypatch, each_mib=500, available_mib=1200)
    cfgs = [RunConfig.from_dict({"lr": lr, "pack": True}) for lr in (1e-3, 3e-3, 1e-2)]
    check_memory(cfgs, "cpu")  # each alone fits
    check_memory(cfgs, "cpu", units=[[0], [1], [2]])
    check_memory(cfgs, "cpu", units=[[0, 1], [2]])  # 1000 MiB of 1200
    with pytest.raises(ConfigError, match=r"the pack of 3 runs .* needs about 1.5 GiB, 0.5 GiB each, but there is 1.2 GiB"):
        check_memory(cfgs, "cpu", units=[[0, 1, 2]])


def test_a_packed_sweep_that_cannot_fit_is_refused_before_any_job(tmp_path, monkeypatch):
    fixed_memory(monkeypatch, each_mib=500, available_mib=1200)
    line = assert_one_line(normlab_here("train", "-m", "lr=1e-3,3e-3,1e-2", "pack=true", *TINY, cwd=tmp_path),
                           "pack=true: the pack of 3 runs", "pack=false")
    assert "needs about 1.5 GiB" in line
    assert not trained(tmp_path) and not (tmp_path / "multirun").exists()


def test_the_run_dir_check_creates_nothing(tmp_path):
    check_output_dir(str(tmp_path / "a" / "b"), "hydra.run.dir")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="the run dir must be a path"):
        check_output_dir("", "hydra.run.dir")


def test_typo_suggestions_come_from_the_schema():
    assert suggest_key("nrom") == "norm"
    assert suggest_key("model.dmodel") == "model.d_model"
    assert suggest_key("optim.weightdecay") == "optim.weight_decay"
    assert suggest_key("lr_rate") == "lr"
    assert suggest_key("model.zzz") is None  # never the parent that lacks it
    assert suggest_key("xyzzy") is None
    assert unknown_key_message("nrom", "rms") == "nrom=rms: nrom is not a config key; did you mean norm=rms?"


def test_saved_configs_with_an_unknown_key_still_load_without_validation():
    # sample and compare read old config.json files: a key since removed must not stop them
    assert RunConfig.from_dict({"depth": 3, "removed_key": 1}, validate=False).depth == 3
    with pytest.raises(ConfigError, match="removed_key is not a config key"):
        RunConfig.from_dict({"depth": 3, "removed_key": 1})


def test_hydras_own_keys_and_groups_and_presets_are_not_refused():
    from normlab.launch.prechecks import CONFIG_MODULE
    from normlab.launch.overrides import check_command_line, check_composition

    line = ["hydra/job_logging=disabled", "hydra.job.chdir=false", "experiment=norm_grid", "norm=rms", "norm.eps=1e-6"]
    check_command_line(line, [], True, CONFIG_MODULE)
    [cfg] = check_composition(line, [], CONFIG_MODULE)
    assert cfg.norm.eps == 1e-6 and list(cfg.hydra.sweeper.params) == ["norm", "placement"]


def test_dotted_keys_build_the_config_they_name_with_or_without_validation():
    # a checkpoint's config is flattened: its dotted keys once fell silently back to the 128-wide default model
    flat = {"model.d_model": 64, "model.n_head": 2, "norm.name": "rms", "optim.betas": [0.9, 0.99], "depth": 3}
    for validate in (True, False):
        cfg = RunConfig.from_dict(flat, validate=validate)
        assert (cfg.model.d_model, cfg.model.n_head, cfg.norm.name, cfg.optim.betas, cfg.depth) == (64, 2, "rms", [0.9, 0.99], 3)
    mixed = RunConfig.from_dict({"model": {"n_head": 2}, "model.d_model": 64})
    assert (mixed.model.d_model, mixed.model.n_head) == (64, 2)
    with pytest.raises(ConfigError, match=r"^model\.d_model is given twice, as 32 \(nested\) and 64 \(dotted\)"):
        RunConfig.from_dict({"model": {"d_model": 32}, "model.d_model": 64}, validate=False)
    with pytest.raises(ConfigError, match=r"^norm\.eps=1e-06: norm is rms, not a mapping"):
        RunConfig.from_dict({"norm": "rms", "norm.eps": 1e-6}, validate=False)
    with pytest.raises(ConfigError, match="model.dmodel is not a config key; did you mean model.d_model"):
        RunConfig.from_dict({"model.dmodel": 64})
