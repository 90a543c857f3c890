"""The real `normlab` command: runs, multiruns, help, and one-line errors for bad input."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_here import normlab_here
from normlab.cli import main
from normlab.config import NORMS, PLACEMENTS

TINY = ["model=tiny", "max_steps=2", "eval_every=1", "eval_batches=1", "batch_size=4", "seq_len=16", "progress=false", "device=cpu"]


def normlab(*args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-m", "normlab", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("summary.json") if "wandb" not in p.parts)


# The core grid; tests/test_variant_smoke.py trains every other norm option, placement and QK-norm.
CORE_NORMS, CORE_PLACEMENTS = ("none", "layer", "rms", "batch"), ("pre", "post")


def test_the_core_norms_and_placements_train_through_the_real_command(tmp_path):
    assert set(CORE_NORMS) <= set(NORMS) and set(CORE_PLACEMENTS) <= set(PLACEMENTS)
    norms, placements = ",".join(CORE_NORMS), ",".join(CORE_PLACEMENTS)
    result = normlab_here("train", "-m", f"norm={norms}", f"placement={placements}", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    dirs = run_dirs(tmp_path / "outputs" / "sweeps")
    assert len(dirs) == len(CORE_NORMS) * len(CORE_PLACEMENTS)
    assert len({d.parent for d in dirs}) == 1  # one sweep dir
    arms, groups = set(), set()
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        assert summary["status"] == "completed", summary
        arms.add((summary["norm"], summary["placement"]))
        groups.add(summary["group"])
        assert d.name.endswith(f"{summary['norm']}-{summary['placement']}-d2-lr3e-3-s0")
        rows = [json.loads(line) for line in (d / "metrics.jsonl").open()]
        assert rows[-1]["step"] == 2 and "val_loss" in rows[-1]
        assert (d / ".hydra" / "config.yaml").exists()
        assert list((d / "wandb").glob("offline-run-*"))
    assert arms == {(n, p) for n in CORE_NORMS for p in CORE_PLACEMENTS}
    assert groups == {f"norm+placement_{dirs[0].parent.name}"}  # the wandb group: the swept keys and the sweep's stamp


def test_two_runs_started_in_the_same_second_get_their_own_dirs_and_say_what_they_did(tmp_path):
    """Two runs of one config at once: a dir each, named after the run, with Hydra's config, and a log file
    that says what the run did, as the terminal does."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "normlab", "train", "norm=rms", "placement=pre", "lr=1e-3", "wandb.mode=disabled", *TINY],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    dirs = run_dirs(tmp_path / "outputs" / "runs")
    assert len(dirs) == 2
    for d in dirs:
        assert "_rms-pre-d2-lr1e-3-s0_" in d.name
        saved = (d / ".hydra" / "config.yaml").read_text()
        assert "name: rms" in saved and "lr: 0.001" in saved

        log = (d / "normlab.log").read_text()
        [stdout] = [out for out, _ in outputs if f"run dir {d.resolve()}" in out]
        start = "rms-pre-d2-lr1e-3-s0: cpu, fp32, "
        assert start in log and f"parameters, run dir {d.resolve()}" in log and start in stdout
        summary = json.loads((d / "summary.json").read_text())
        end = f"rms-pre-d2-lr1e-3-s0 completed: final val loss {summary['final_val_loss']:.4f} ({summary['final_val_bpb']:.4f} bits/byte)"
        assert end in log and end in stdout and "tokens/s, training loop " in log


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["norm=group"], "norm='group'"),
        (["placement=middle"], "placement='middle'"),
        (["-m", "placement=pre,middle"], "placement='middle'"),
        (["lr=0"], "lr=0"),
        (["lr=-3e-4"], "lr=-0.0003"),
        (["depth=0"], "depth=0"),
        (["model.n_head=3"], "model.n_head=3"),
        (["batch_size=10", "grad_accum=3"], "grad_accum=3"),
        (["seq_len=512"], "seq_len=512"),
    ],
)
def test_bad_config_gives_one_clear_line(tmp_path, monkeypatch, capsys, overrides, key):
    # cli.main in this process, as `python -m normlab` calls it; test_bad_input runs such cases as the real command too.
    monkeypatch.chdir(tmp_path)
    assert main(["train", *overrides, "max_steps=1"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("normlab: error: ") and key in lines[0]
    assert "Traceback" not in out + err
    assert not run_dirs(tmp_path)


def test_hub_dataset_without_network_fails_fast_with_one_line(tmp_path):
    start = time.monotonic()
    result = normlab_here("train", "data=hf", "data.name=surely/not-a-cached-dataset", *TINY, cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "surely/not-a-cached-dataset" in line and "cache" in line
    assert elapsed < 30  # in this process: the checks and the hub's lookup (about a second at most), no interpreter start


HELP_LINES = {
    "--help": ["usage: normlab"],
    "train": ["normlab", "norm: batch, batch_causal, derf, dyt, l2, layer, layer_nobias, layer_noweight, none, rms, rms_noweight, scale",
              "model: medium, small, tiny", "data: hf, stdlib, text"],
}


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_lists_the_options_and_imports_no_heavy_module(argv, tmp_path):
    # Help must answer in well under 2 s: importing torch, wandb or matplotlib alone takes seconds.
    code = (
        "import sys, contextlib, io\n"
        "from normlab.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})  # Hydra exits after printing its help\n"
        "print(out.getvalue())\n"
        "print(sorted(m for m in ('torch', 'wandb', 'matplotlib', 'datasets') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    *help_text, heavy = result.stdout.strip().splitlines()
    assert heavy == "[]"
    for line in HELP_LINES[argv[0]]:
        assert line in "\n".join(help_text)


def test_version_prints_normlabs_version(capsys):
    from importlib.metadata import version

    for argv in (["--version"], ["train", "--version"]):
        assert main(argv) == 0
        assert capsys.readouterr().out.strip() == f"normlab {version('normlab')}"


def _complete(script: str, line: str, tmp_path) -> list[str]:
    """What bash offers for `line` (the cursor at its end) with the completion `script` that
    `normlab train -sc install=bash` printed."""
    words = line.split() + ([""] if line.endswith(" ") else [])
    bash = (
        f"{script}\nCOMP_LINE={shlex.quote(line)}; COMP_POINT={len(line)}; COMP_WORDS=({' '.join(map(shlex.quote, words))}); "
        f"COMP_CWORD={len(words) - 1}; hydra_bash_completion; printf '%s\\n' \"${{COMPREPLY[@]}}\""
    )
    bin_dir = str(Path(sys.executable).parent)
    result = subprocess.run(["bash", "-c", bash], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]})
    assert "unknown command" not in result.stderr, result.stderr
    return result.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("normlab", path=str(Path(sys.executable).parent)) is None,
                    reason="needs bash and the installed normlab script")
def test_tab_completion_completes_commands_groups_and_options(tmp_path):
    script = normlab_here("train", "-sc", "install=bash", cwd=tmp_path).stdout
    assert "complete -o nospace -o default -F hydra_bash_completion normlab" in script
    assert _complete(script, "normlab tr", tmp_path) == ["train"]
    assert {"norm=rms", "norm=rms_noweight"} <= set(_complete(script, "normlab train norm=rm", tmp_path))
    assert "model=tiny" in _complete(script, "normlab train norm=rms model=t", tmp_path)
    assert "wandb.on_unreachable=" in _complete(script, "normlab train wandb.on", tmp_path)


def test_off_a_terminal_the_progress_bar_becomes_log_lines(tmp_path):
    tiny = [a for a in TINY if not a.startswith(("progress", "max_steps", "eval_every"))]
    result = normlab_here("train", "wandb.mode=disabled", "progress=true", "max_steps=20", "eval_every=10", "log_every=1", *tiny, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [d] = run_dirs(tmp_path / "outputs" / "runs")
    lines = [line for line in (d / "normlab.log").read_text().splitlines() if ": step " in line]
    assert [line.split(": step ")[1].split("/")[0] for line in lines] == [str(s) for s in range(0, 20, 2)]
    assert "val_loss" in lines[0] and "val_loss" in lines[5] and "it/s" not in result.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("normlab", path=str(Path(sys.executable).parent)) is None,
                    reason="needs bash and the installed normlab script")
def test_tab_completion_offers_every_value_of_a_key_with_fixed_choices(tmp_path):
    # placement is a key, not a config group: Hydra alone offers its current value only (placement=pre).
    script = normlab_here("train", "-sc", "install=bash", cwd=tmp_path).stdout
    assert set(_complete(script, "normlab train placement=", tmp_path)) == {f"placement={p}" for p in PLACEMENTS}
    assert _complete(script, "normlab train norm=rms placement=s", tmp_path) == ["placement=sandwich"]
    assert _complete(script, "normlab train -m placement=pre,p", tmp_path) == ["placement=pre,post"]
    assert set(_complete(script, "normlab train qk_norm=", tmp_path)) == {"qk_norm=true", "qk_norm=false"}


def test_a_sweep_with_cfg_gives_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", "norm=rms,layer", "--cfg", "job"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("normlab: error: ") and "-m with --cfg" in err
    assert "Traceback" not in err and not (tmp_path / "outputs").exists()


def test_a_sweep_preset_without_m_is_refused_unless_each_swept_key_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "experiment=norm_grid", "max_steps=1"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("normlab: error: experiment=norm_grid holds a sweep of 8 jobs over norm, placement")
    assert "normlab train -m experiment=norm_grid max_steps=1" in line and "norm=none placement=pre" in line
    assert not (tmp_path / "outputs").exists()
    # One job of the sweep, every swept key given (what a sweep job's saved overrides are): a single run.
    assert main(["train", "experiment=norm_grid", "norm=rms", "placement=post", "--cfg", "job"]) == 0
    printed = capsys.readouterr().out
    assert "placement: post" in printed and "\nnorm:\n  name: rms\n" in printed


def test_a_relative_data_file_under_chdir_is_read_from_the_launch_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("the residual stream of a transformer " * 400)
    run_dir = tmp_path / "run"
    result = normlab_here("train", "data=text", "data.files=[notes.txt]", "hydra.job.chdir=true", f"hydra.run.dir={run_dir}",
                     "wandb.mode=disabled", *TINY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "config.json").read_text())["data"]["files"] == [str(tmp_path / "notes.txt")]
    # Resumed by its dir (the command replays hydra.job.chdir=true too): the same config, so nothing to train.
    again = normlab_here("resume", str(run_dir), cwd=tmp_path)
    assert again.returncode == 0 and "already completed" in again.stderr, again.stderr[-3000:]


def into_head(args, cwd, keep: int = 0) -> tuple[int, bytes, str]:
    """`normlab ARGS | head -c KEEP` in a fresh process: its exit code, the bytes the reader took and its stderr.
    The reader closes its end once it has KEEP bytes; with KEEP 0 it is closed before normlab starts, so normlab's
    first write finds it gone, however little it prints."""
    with open(Path(cwd) / "stderr.txt", "w+") as err:
        if keep == 0:
            read, write = os.pipe()
            os.close(read)
            try:
                code = subprocess.run([sys.executable, "-m", "normlab", *map(str, args)], stdout=write, stderr=err,
                                      cwd=cwd, timeout=300).returncode
            finally:
                os.close(write)
            taken = b""
        else:
            process = subprocess.Popen([sys.executable, "-m", "normlab", *map(str, args)], stdout=subprocess.PIPE,
                                       stderr=err, cwd=cwd)
            taken = process.stdout.read(keep)
            process.stdout.close()
            code = process.wait(timeout=300)
        err.seek(0)
        return code, taken, err.read()


@pytest.mark.parametrize("command", ["ls", "compare"])
def test_a_reader_that_stops_early_ends_the_listing_quietly(tmp_path, command):
    """`normlab ls | head -1`: as a Unix tool, no traceback, and the shell's code for a pipe gone (128 + SIGPIPE)."""
    from test_compare import write_run

    for i in range(3):
        write_run(tmp_path / "sweep" / f"{i}_rms", lr=10.0 ** -(i + 2))
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    code, _, err = into_head([command, "sweep"], tmp_path)
    assert (code, err) == (141, "")
