"""Every telemetry statistic keeps its value: the live Probe against a frozen copy of it.

tests/telemetry_reference/ is the Probe as it was at commit 9034483 (named in its files' headers), before its
statistics were batched. Each case below trains a tiny model for 3 steps with telemetry at steps 0 and 2, and measures
them twice on the very same forward and backward passes: by the live Probe, driven by the training loop
as in any run, and by the reference Probe, driven by a callback that makes the calls the Telemetry
callback made at that commit (watch() around the step's micro-batches, measure_gradients after backward,
before_update before the optimizer step, collect after it). A pack is trained twice on one thread, once
with the reference PackedProbe in place of the live one, and compared member by member.

Every key the reference logs must be logged, with its value, and no other: a key added on purpose is
listed in ADDED with its own independent computation, a key whose definition changed on purpose in
CHANGED (the reference keeps the old definition).

The reference is driven by the loop's generic callback hooks, so a new way of driving the live Probe (other
calls from the Telemetry callback, statistics out of the model's own forward) leaves it as it is. The pack
case swaps the reference in through normlab.train.pack.trainer.PackedProbe and so relies on the pack loop
calling it as at that commit (watch, the watcher's taps/begin/end/absorb, measure_gradients, before_update,
collect). compile=true is not among the cases: today it runs telemetry steps on the eager model.
"""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from conftest import tiny_config
from normlab.config import RunConfig, TelemetryConfig
from normlab.keys import parse
from normlab.train.callbacks import Callback
from normlab.train.pack import train_pack
from normlab.train.run import train
from normlab.train.sinks import MetricsFile, RunDir
from telemetry_reference.pack_telemetry import PackedProbe as ReferencePackedProbe
from telemetry_reference.probe import PROBE_SEQS
from telemetry_reference.probe import Probe as ReferenceProbe
from test_pack import RATIO_TOLERANCE

# fp32: the bound the docs give for a member against its unpacked run, relative.
TOLERANCE = 1e-5
# Values at or near 0 are held to an absolute floor instead, on the scale of what the statistic is made of:
# a mean cosine between tokens (near 0 for near-orthogonal tokens) on a cosine's range, 1; an angle (near 0
# for a block near the identity) on one radian, in degrees; anything else on one float32 rounding of an
# O(1) value, 1e-7 (the gains' std is exactly 0 at initialization, and a std of ones may come out as one
# rounding of them).
ABSOLUTE_FLOOR = {"act/token_cos/": 1.0, "act/block_angle/": math.degrees(1.0), "act/block_angle_last/": math.degrees(1.0)}
OTHER_FLOOR = 1e-7 / TOLERANCE  # as a multiple of the tolerance, like the scales above
# bf16 autocast: many tensors the statistics read are bf16 (the sublayers' outputs, queries and keys, the
# logits), whose unit roundoff is 2^-8 = 3.9e-3. An implementation may read a statistic from a tensor rounded
# to bf16 once more or once less than the reference did (a fused or compiled graph keeps in float32 what eager
# rounds), which moves a max or a median by up to one rounding and a ratio of two by two: held to 1e-2 (about
# 2.5 roundings), the floors alike. Today's implementation agrees with the reference exactly there too.
BF16_TOLERANCE = 1e-2

# The statistics the live Probe logs and the reference does not, and those whose definition
# changed on purpose, by `family` (grad/norm is the whole block's grad/norm/Lxx, grad/norm/mlp its MLP's): each
# is compared against its definition computed here, in float64, from the tensors the run's hooks and gradients
# held (`expected_new`), never against the reference.
ADDED = {"act/top_median_max"}
# act/max_median(_max): each token centred over its features first, as He et al.'s code does (the reference: not).
# grad/norm/Lxx: over the block's attention and MLP weights, as update_ratio/Lxx (the reference: every parameter
# of the block, its norms and residual gates too).
CHANGED = {"act/max_median", "act/max_median_max", "grad/norm"}

STEPS, EVERY = 3, 2  # telemetry at steps 0 and 2 (the last); step 1 is a plain logged step
TELEMETRY_STEPS = (0, 2)

CASES = {
    "rms-pre": ("rms", "pre", {}),
    "layer-post": ("layer", "post", {}),
    "derf": ("derf", "pre", {}),
    "scale": ("scale", "pre", {}),
    "l2": ("l2", "pre", {}),
    "batch-sandwich": ("batch", "sandwich", {}),  # running variance, branch norms
    "softcap": ("rms", "pre", {"attn_softcap": 1.0}),
    "qk_norm-head": ("rms", "pre", {"qk_norm": True}),
    "qk_norm-all": ("layer", "pre", {"qk_norm": True, "qk_norm_axis": "all"}),
    "embed_norm": ("rms", "pre", {"embed_norm": True}),
    "layerscale": ("rms", "pre", {"residual_gate": "layerscale"}),
    "rezero": ("layer", "pre", {"residual_gate": "rezero"}),  # gates at 0: update_ratio/Lxx/gate1 is NaN at step 0
    "grad_accum=2": ("layer", "pre", {"grad_accum": 2}),  # the 8 probed sequences span both micro-batches
    "bf16": ("rms", "pre", {"precision": "bf16"}),
}


def golden_run(cfg: RunConfig, path) -> tuple[dict[int, dict], ReferenceTelemetry]:
    """Train `cfg` in `path` with the reference watching too: the records of metrics.jsonl by step, and the reference."""
    reference = ReferenceTelemetry(cfg)
    run_dir = RunDir(path)
    train(cfg, run_dir, sinks=[MetricsFile(run_dir)], callbacks=[reference])
    records = [json.loads(line) for line in run_dir.metrics_path.read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    assert sorted(reference.stats) == sorted(reference.streams) == list(TELEMETRY_STEPS)
    assert reference.records[1] == by_step[1]
    return by_step, reference


def golden_config(norm: str, placement: str, text_data, **overrides) -> RunConfig:
    cfg = tiny_config(norm, placement, data=text_data, max_steps=STEPS, eval_every=0, log_every=1,
                      telemetry=TelemetryConfig(every=EVERY), **overrides)
    cfg.wandb.mode = "disabled"
    return cfg


def sublayer_grad_norm(block) -> float:
    """The L2 norm, in float64, of the gradient of a block's attention and MLP weights (not QK-norm's gains)."""
    qk = {id(p) for norm in (block.attn.q_norm, block.attn.k_norm) for p in norm.parameters()}
    params = [p for p in (*block.attn.parameters(), *block.mlp.parameters()) if id(p) not in qk]
    return math.sqrt(sum(p.grad.double().square().sum().item() for p in params if p.grad is not None))


def lower_median(a: torch.Tensor) -> torch.Tensor:
    """The lower of the two middle values for an even count (torch.median's), over the last dimension."""
    return a.sort(-1).values[..., (a.size(-1) - 1) // 2]


def expected_new(reference: ReferenceTelemetry, step: int) -> dict[str, float]:
    """The ADDED and CHANGED statistics of `step` in float64, from the stream after each block (B, T, d) and
    the sublayers' gradients that `reference` kept."""
    out = {f"grad/norm/{label}": norm for label, norm in reference.sublayer_grads[step].items()}
    for label, y in reference.streams[step].items():
        y = y[:PROBE_SEQS]
        seqs = y.abs().flatten(1)  # Sun et al.: one ratio per sequence, over its T·d values
        out[f"act/top_median_max/{label}"] = (seqs.amax(-1) / lower_median(seqs)).max().item()
        tokens = (y - y.mean(-1, keepdim=True)).abs()  # He et al.: one ratio per token, centred over its features
        ratios = tokens.amax(-1) / lower_median(tokens)
        out[f"act/max_median/{label}"] = ratios.mean().item()
        out[f"act/max_median_max/{label}"] = ratios.max().item()
    return out


class ReferenceTelemetry(Callback):
    """The reference Probe on the run's telemetry steps, called as the Telemetry callback called the Probe at
    the reference's commit; keeps its statistics, the record the sinks got and, from hooks of its own, the
    float64 stream after each block (`streams`), by step."""

    name = "reference_telemetry"

    def __init__(self, cfg: RunConfig):
        self.every, self.max_steps = cfg.telemetry.every, cfg.max_steps
        self.stats: dict[int, dict[str, float]] = {}
        self.records: dict[int, dict] = {}
        self.streams: dict[int, dict[str, torch.Tensor]] = {}
        self.sublayer_grads: dict[int, dict[str, float]] = {}
        self._watching = None
        self._step = None

    def on_train_start(self, state) -> None:
        self.probe = ReferenceProbe(state.model, self.every, self.max_steps)

    def on_step_start(self, state) -> None:
        self._step = state.step if self.probe.active(state.step) else None
        if self._step is not None:
            self._watching = contextlib.ExitStack()
            self._watching.enter_context(self.probe.watch())
            chunks: dict[str, list[torch.Tensor]] = {}
            for label, block in zip(self.probe.labels, state.model.blocks):
                handle = block.register_forward_hook(
                    lambda m, args, out, label=label: chunks.setdefault(label, []).append(out.detach().double()))
                self._watching.callback(handle.remove)
            self._watching.callback(lambda: self.streams.__setitem__(
                self._step, {label: torch.cat(c) for label, c in chunks.items()}))

    def after_backward(self, state) -> None:
        if self._step is not None:
            self._watching.close()
            self.probe.measure_gradients(state.scaler)
            self.sublayer_grads[self._step] = {label: sublayer_grad_norm(block)
                                               for label, block in zip(self.probe.labels, state.model.blocks)}

    def before_optimizer_step(self, state) -> None:
        if self._step is not None:
            self.probe.before_update()

    def after_optimizer_step(self, state, record) -> None:
        if self._step is not None:
            self.stats[self._step] = self.probe.collect()

    def on_step_end(self, state, record) -> None:
        if record is not None:
            self.records[state.step - 1] = dict(record)


def telemetry_part(record: dict, plain: dict) -> dict:
    """The keys of a telemetry step's `record` that a plain logged step's record (`plain`) does not hold."""
    return {k: v for k, v in record.items() if k not in plain}


def family(key: str) -> str:
    """A per-layer key without its layer ('grad/norm/L01/mlp': 'grad/norm/mlp'); any other key as it is."""
    parsed = parse(key)
    return parsed.stat + (f"/{parsed.part}" if parsed.part else "") if parsed else key


def assert_agree(live: dict, reference: dict, new: dict, tolerance: float, where: str,
                 new_tolerance: float | None = None) -> None:
    """`live` holds the keys of `reference` and of `new` (the ADDED and CHANGED statistics' values computed in
    the test) and no other; each with the value `new` gives (within `new_tolerance`, by default `tolerance`),
    else the reference's."""
    assert {family(k) for k in new} == ADDED | CHANGED, f"{where}: the test computed {sorted(new)}"
    assert not {k for k in reference if family(k) in ADDED}, f"{where}: ADDED lists a key the reference logs"
    missing = sorted((reference.keys() | new.keys()) - live.keys())
    added = sorted(live.keys() - reference.keys() - new.keys())
    assert not missing and not added, f"{where}: keys missing {missing}, keys added {added}"
    bad = {}
    for key, want in {**reference, **new}.items():
        got = float(live[key]) if live[key] is not None else math.nan  # metrics.jsonl writes NaN as null
        if math.isnan(want) or math.isnan(got):
            if not (math.isnan(want) and math.isnan(got)):
                bad[key] = (got, want)
            continue
        floor = next((s for prefix, s in ABSOLUTE_FLOOR.items() if key.startswith(prefix)), OTHER_FLOOR)
        bound = new_tolerance if key in new and new_tolerance is not None else tolerance
        if abs(got - want) > bound * max(abs(want), floor):
            bad[key] = (got, want)
    assert not bad, f"{where}: (live, reference) {bad}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_live_probe_logs_what_the_reference_does(case, tmp_path, text_data, one_thread):
    norm, placement, overrides = CASES[case]
    cfg = golden_config(norm, placement, text_data, **overrides)
    by_step, reference = golden_run(cfg, tmp_path / "run")
    tolerance = BF16_TOLERANCE if cfg.precision == "bf16" else TOLERANCE
    for step in TELEMETRY_STEPS:
        assert reference.stats[step], f"{case}: the reference measured nothing at step {step}"
        assert_agree(telemetry_part(by_step[step], by_step[1]), reference.stats[step],
                     expected_new(reference, step), tolerance, f"{case} step {step}")


def test_each_member_of_a_pack_logs_what_the_reference_does(tmp_path, text_data, monkeypatch, one_thread):
    """Three members (one lr each), with LayerScale gates and QK-norm: the live PackedProbe, then the reference's.
    The ADDED and CHANGED statistics are computed from each member's unpacked run (the reference watching it),
    whose activations differ from the packed member's by the batched kernels' rounding: they are held to
    test_pack's bound for a ratio of a max and a median (a mean over tokens stays within 1e-5 there)."""
    import normlab.train.pack.trainer as trainer

    cfgs = [golden_config("rms", "pre", text_data, lr=lr, residual_gate="layerscale", qk_norm=True, sinks=["jsonl"])
            for lr in (1e-3, 3e-3, 1e-2)]

    def records(name: str) -> list[dict[int, dict]]:
        out = []
        for i in range(3):
            lines = (tmp_path / f"{name}{i}" / "metrics.jsonl").read_text().splitlines()
            out.append({r["step"]: r for r in map(json.loads, lines) if "loss" in r})
        return out

    train_pack([(cfg, tmp_path / f"live{i}") for i, cfg in enumerate(cfgs)])
    with monkeypatch.context() as patched:
        patched.setattr(trainer, "PackedProbe", ReferencePackedProbe)
        train_pack([(cfg, tmp_path / f"reference{i}") for i, cfg in enumerate(cfgs)])
    for m, (live, reference) in enumerate(zip(records("live"), records("reference"))):
        _, alone = golden_run(cfgs[m], tmp_path / f"alone{m}")
        for step in TELEMETRY_STEPS:
            want = telemetry_part(reference[step], reference[1])
            assert len(want) > 50 and "grad/norm/L01/gate2" in want
            assert_agree(telemetry_part(live[step], live[1]), want, expected_new(alone, step), TOLERANCE,
                         f"member {m} step {step}", new_tolerance=RATIO_TOLERANCE)


def test_the_comparison_fails_on_a_changed_value():
    """assert_agree is not vacuous: a value off by 2e-5 relative, a gain std of 2e-7 where 0 is expected, a key
    gone, a key new, a new statistic's value off, each fails it."""
    reference = {"act/resid_rms/L00": 1.5, "act/token_cos/L00": 1e-3, "norm/gain_std/L00/norm1": 0.0}
    new = {f"{stat}/L00": 2.0 for stat in ADDED | CHANGED}
    assert_agree({**reference, **new}, reference, new, TOLERANCE, "same")
    for live in ({**reference, "act/resid_rms/L00": 1.5 * (1 + 2e-5)},
                 {**reference, "norm/gain_std/L00/norm1": 2e-7},
                 {k: v for k, v in reference.items() if k != "act/token_cos/L00"},
                 {**reference, "act/new_stat/L00": 1.0}):
        with pytest.raises(AssertionError):
            assert_agree({**live, **new}, reference, new, TOLERANCE, "changed")
    for key in new:
        with pytest.raises(AssertionError):
            assert_agree({**reference, **new, key: 2.0 * (1 + 2e-5)}, reference, new, TOLERANCE, "new changed")
