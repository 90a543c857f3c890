"""Every norm and placement variant through the `normlab train` command: one multirun, run in this process
(tests/inprocess.py: a subprocess would import torch, Hydra and wandb again)."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from inprocess import Commands
from normlab.config import RunConfig
from normlab.nn.model import GPT

# One job per arm, together covering every new norm option, placement, and QK-norm:
# arm -> (norm option, top-level keys, expected run label).
ARMS = {
    "dyt_mix_qk": ("dyt", {"placement": "mix", "mix_p": 0.5, "qk_norm": True}, "dyt-mix0.5-qk"),
    "scale_deepnorm_qk": ("scale", {"placement": "deepnorm", "qk_norm": True}, "scale-deepnorm-qk"),
    "l2_sandwich": ("l2", {"placement": "sandwich"}, "l2-sandwich"),
    "rms_noweight_post": ("rms_noweight", {"placement": "post"}, "rms_noweight-post"),
    "layer_noweight_deepnorm": ("layer_noweight", {"placement": "deepnorm"}, "layer_noweight-deepnorm"),
    "layer_nobias_sandwich_qk": ("layer_nobias", {"placement": "sandwich", "qk_norm": True}, "layer_nobias-sandwich-qk"),
    "batch_causal_mix": ("batch_causal", {"placement": "mix", "mix_p": 0.5}, "batch_causal-mix0.5"),
    "none_pre_qk": ("none", {"placement": "pre", "qk_norm": True}, "none-pre-qk"),
}
# The 2024–2026 arms: every new placement, switch, norm and attention option at least once.
NEW_ARMS = {
    "derf_reordered_qkall": ("derf", {"placement": "reordered", "qk_norm": True, "qk_norm_axis": "all"},
                             "derf-reordered-qk_all"),
    "batch_lns_embnorm": ("batch", {"placement": "lns", "embed_norm": True}, "batch-lns-embnorm"),
    "rms_post_final_cap": ("rms", {"placement": "post", "final_norm": True, "attn_softcap": 20.0},
                           "rms-post-final-cap20"),
    "layer_pre_headgains_layerscale_z": ("layer", {"placement": "pre", "qk_norm": True, "qk_norm_gains": "head",
                                                   "residual_gate": "layerscale", "z_loss": 1e-4},
                                         "layer-pre-qk_headgains-layerscale-z1e-4"),
    "none_sandwich_rezero_nofinal": ("none", {"placement": "sandwich", "residual_gate": "rezero", "final_norm": False},
                                     "none-sandwich-nofinal-rezero"),
}
ARMS.update(NEW_ARMS)


def write_arm_group(conf_dir: Path) -> None:
    """A config group `arm` whose options each pick a norm option and set placement keys."""
    (conf_dir / "arm").mkdir(parents=True)
    for arm, (norm, keys, _) in ARMS.items():
        lines = ["# @package _global_", "defaults:", f"  - override /norm: {norm}"]
        lines += [f"{k}: {json.dumps(v)}" for k, v in keys.items()]
        (conf_dir / "arm" / f"{arm}.yaml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def commands(monkeypatch):
    return Commands(monkeypatch)


def _train(commands: Commands, tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    """`normlab train -m` over the arm group, on a small local corpus, in tmp_path."""
    write_arm_group(tmp_path / "conf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def norm(x):\n    return x / (x * x).mean() ** 0.5\n" * 400)
    cmd = [
        "normlab",
        "train",
        "-m",
        "--config-dir",
        "conf",
        *args,
        "model=tiny",
        "data=text",
        f"data.files=[{corpus}]",
        "seq_len=32",
        "batch_size=4",
        "max_steps=2",
        "eval_every=1",
        "eval_batches=1",
        "log_every=1",
        "progress=false",
        "device=cpu",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return commands.run(cmd, tmp_path, env)


def test_every_variant_trains_through_normlab_train(tmp_path, commands):
    proc = _train(commands, tmp_path, ["+arm=" + ",".join(ARMS)])
    assert proc.returncode == 0, proc.stderr[-3000:]

    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    job_dirs = sorted((d for d in sweep.iterdir() if d.is_dir()), key=lambda d: int(d.name.split("_")[0]))
    assert len(job_dirs) == len(ARMS)
    for job_dir, (arm, (norm, keys, label)) in zip(job_dirs, ARMS.items()):
        summary = json.loads((job_dir / "summary.json").read_text())
        assert summary["status"] == "completed", (arm, summary)
        assert summary["name"] == f"{label}-d2-lr3e-3-s0" and job_dir.name.endswith("_" + summary["name"])
        assert summary["norm"] == norm and summary["qk_norm"] == keys.get("qk_norm", False)
        assert math.isfinite(summary["final_val_loss"])

        # The job trained the model its arm describes.
        cfg = RunConfig.from_dict(json.loads((job_dir / "config.json").read_text()))
        cfg.model.vocab_size = cfg.model.vocab_size or 256  # null: the byte tokenizer's, as the loop resolves it
        assert cfg.norm.label == norm and all(getattr(cfg, key) == value for key, value in keys.items())
        assert summary["n_params"] == GPT(cfg).num_params()

        records = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1, 2]
        assert all(math.isfinite(r["val_loss"]) for r in records)
        assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
        assert all(("z_loss" in r) == bool(keys.get("z_loss")) for r in records if "loss" in r)
        assert list((job_dir / "wandb").glob("offline-run-*"))


def test_every_new_arm_trains_packed_through_normlab_train(tmp_path, commands):
    """pack=true with two lrs: each new arm is a pack of two members, each an ordinary run."""
    arms = ",".join(NEW_ARMS)
    proc = _train(commands, tmp_path, [f"+arm={arms}", "lr=1e-3,3e-3", "pack=true", "telemetry.every=0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("[pack of 2]") == 2 * len(NEW_ARMS)
    (sweep,) = (tmp_path / "outputs" / "sweeps").iterdir()
    summaries = [json.loads(p.read_text()) for p in sweep.glob("*/summary.json")]
    expected = {f"{label}-d2-lr{lr}-s0" for _, _, label in NEW_ARMS.values() for lr in ("1e-3", "3e-3")}
    assert {s["name"] for s in summaries} == expected
    assert all(s["status"] == "completed" and s["pack_size"] == 2 and math.isfinite(s["final_val_loss"]) for s in summaries)
