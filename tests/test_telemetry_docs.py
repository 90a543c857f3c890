"""docs/telemetry.md's key table lists exactly the keys the Probe logs: derived from the table and from runs."""

import json
import re
from pathlib import Path

import pytest

from conftest import tiny_config
from normlab.config import TelemetryConfig
from normlab.train.run import train
from normlab.train.sinks import MetricsFile, RunDir

DOC = Path(__file__).resolve().parents[1] / "docs" / "telemetry.md"
# A key, as the table writes it in backticks: a telemetry family, then slash-separated names ('...' or '…' at
# the start stands for the previous key's head).
KEY = re.compile(r"^(?:act|grad|update_ratio|norm|attn|out)/[\w/]+$")
LAYER = re.compile(r"^L\d+$")
NORM_SLOT = re.compile(r"^(?:norm\d(?:_out)?|q_norm|k_norm|norm_f|norm_embed)$")
# Arms that between them have every kind of key: running variance, branch and embedding norms (BatchNorm
# sandwich); α, shift and residual gates (Derf, LayerScale); QK-norm and ε (RMSNorm).
ARMS = [("batch", "sandwich", {"embed_norm": True}), ("derf", "pre", {"residual_gate": "layerscale"}),
        ("rms", "pre", {"qk_norm": True})]


def family(key: str) -> str:
    """A key with its block left out and any norm slot named <norm>: 'norm/gain_mean/L03/q_norm' and
    'norm/gain_mean/norm_f' are both 'norm/gain_mean/<norm>'."""
    return "/".join("<norm>" if NORM_SLOT.match(p) else p for p in key.split("/") if not LAYER.match(p))


def documented() -> set[str]:
    """The families of the keys the Keys table's first column names, '.../mlp' read after the key before it."""
    text = DOC.read_text()
    table = text[text.index("## Keys"):text.index("\n## ", text.index("## Keys") + 1)]
    families = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        previous = None
        for token in re.findall(r"`([^`]+)`", re.split(r"(?<!\\) \| ", line[2:], maxsplit=1)[0]):
            for dots in ("...", "…"):
                if token.startswith(dots) and previous:
                    token = previous.rsplit("/", 1)[0] + token[len(dots):]
            if KEY.match(token):
                families.add(family(token))
                previous = token
    return families


def logged(tmp_path, text_data) -> set[str]:
    """The families of the keys a telemetry step adds to its record, over ARMS."""
    families = set()
    for norm, placement, overrides in ARMS:
        cfg = tiny_config(norm, placement, data=text_data, max_steps=3, eval_every=0, log_every=1,
                          telemetry=TelemetryConfig(every=2), **overrides)
        cfg.wandb.mode = "disabled"
        run_dir = RunDir(tmp_path / norm)
        train(cfg, run_dir, sinks=[MetricsFile(run_dir)])
        rows = {r["step"]: r for r in map(json.loads, run_dir.metrics_path.read_text().splitlines()) if "loss" in r}
        families |= {family(k) for k in rows[0].keys() - rows[1].keys()}  # step 1 takes no telemetry
    return families


def test_the_key_table_lists_every_key_the_probe_logs_and_no_other(tmp_path, text_data):
    table, runs = documented(), logged(tmp_path, text_data)
    assert {"act/top_median_max", "grad/norm/gate1", "update_ratio/gate2", "norm/eps_ratio/<norm>"} <= runs
    unlisted, unlogged = sorted(runs - table), sorted(table - runs)
    assert (unlisted, unlogged) == ([], []), "(logged but not in docs/telemetry.md's key table, listed but not logged)"


@pytest.mark.parametrize("key, expected", [
    ("grad/norm/L03/mlp", "grad/norm/mlp"), ("update_ratio/norm_f", "update_ratio/<norm>"),
    ("act/norm_in_rms/L12/norm2_out", "act/norm_in_rms/<norm>"), ("grad/norm_f_norm", "grad/norm_f_norm"),
])
def test_family_leaves_out_the_block_and_names_norm_slots_alike(key, expected):
    assert family(key) == expected
