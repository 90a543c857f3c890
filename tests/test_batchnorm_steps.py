"""BatchNorm under gradient accumulation: statistic groups of norm.stat_rows sequences, running statistics
that advance once per optimizer step, and the same model at any grad_accum."""

import json
import logging

import pytest
import torch
from torch import nn

from conftest import tiny_config
from normlab.train.callbacks import Callback
from normlab.config import ConfigError, NormConfig, TelemetryConfig
from normlab.nn.norms import BatchNorm, CausalBatchNorm, build_norm
from normlab.train.run import train



class KeepModel(Callback):
    """Keeps the trained model's buffers at the end of the run."""

    name = "keep_model"

    def on_train_end(self, state, summary):
        self.buffers = {k: v.clone() for k, v in state.model.named_buffers() if "running" in k}


def _run(cfg, tmp_path, name):
    cfg.wandb.mode, cfg.sinks = "disabled", ["jsonl"]
    keep = KeepModel()
    summary = train(cfg, tmp_path / name, callbacks=[keep])
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, records, keep.buffers


# Causal groups of 2 would normalize every pair to ±1, whatever the input: a gradient of rounding noise.
@pytest.mark.parametrize("causal,stat_rows,batch_size", [(False, 2, 8), (True, 4, 16)])
def test_same_stat_rows_at_grad_accum_1_and_4_is_the_same_run(tmp_path, text_data, causal, stat_rows, batch_size,
                                                              one_thread):
    runs = {}
    for accum in (1, 4):
        cfg = tiny_config("batch", "post", data=text_data, grad_accum=accum, batch_size=batch_size, max_steps=5,
                          telemetry=TelemetryConfig(every=2))
        cfg.norm = NormConfig(name="batch", causal=causal, stat_rows=stat_rows)
        # The model builds no shift that a BatchNorm subtracts again (normlab.nn.model.cancelled_shifts),
        # so plain BatchNorm runs the default config. Causal BatchNorm subtracts every per-position constant
        # too: the position embedding and a few shifts keep gradients near fp32 rounding noise (~1e-10 of
        # the largest, measured at init in float64), which AdamW's default eps=1e-8 scales up to updates.
        if causal:
            cfg.optim.eps = 1e-6
        cfg.validate()
        runs[accum] = _run(cfg, tmp_path, f"accum{accum}")
    (one_summary, one, one_buffers), (four_summary, four, four_buffers) = runs[1], runs[4]
    assert one_summary["norm_stat_rows"] == four_summary["norm_stat_rows"] == stat_rows
    assert [r["step"] for r in one] == [r["step"] for r in four]
    for a, b in zip(one, four):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
        for key in (k for k in a if k.startswith(("grad/norm/", "norm/running_var/"))):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert one_buffers.keys() == four_buffers.keys() and one_buffers
    for key, value in one_buffers.items():
        # relative to the buffer's scale: a running mean near 0 holds the noise above at ~1e-4 of it
        torch.testing.assert_close(four_buffers[key], value, rtol=1e-4, atol=1e-3 * value.abs().max().item())


def test_micro_batch_statistics_differ_between_grad_accum_1_and_4_and_the_run_warns(tmp_path, text_data, caplog):
    losses = {}
    for accum in (1, 4):
        cfg = tiny_config("batch", "post", data=text_data, grad_accum=accum, max_steps=2, telemetry=TelemetryConfig(every=0))
        with caplog.at_level(logging.WARNING, logger="normlab"):
            summary, records, _ = _run(cfg, tmp_path, f"accum{accum}")
        assert summary["norm_stat_rows"] == 8 // accum
        losses[accum] = records[1]["loss"]
    warnings = [r.getMessage() for r in caplog.records if "grad_accum changes the model" in r.getMessage()]
    assert len(warnings) == 1 and "grad_accum=4" in warnings[0] and "micro-batch of 2 sequences" in warnings[0]
    assert losses[4] != pytest.approx(losses[1], rel=1e-4)  # a different model: what the warning says


def test_stat_rows_groups_take_their_own_statistics():
    bn = BatchNorm(3, weight=False, bias=False, stat_rows=2)
    x = torch.randn(6, 5, 3) * torch.tensor([1.0, 4.0, 9.0]).view(3, 1, 1).repeat_interleave(2, 0) + 2
    y = bn(x)
    for g in range(3):
        group = x[2 * g : 2 * g + 2].reshape(-1, 3)
        by_hand = (group - group.mean(0)) / torch.sqrt(group.var(0, unbiased=False) + 1e-5)
        torch.testing.assert_close(y[2 * g : 2 * g + 2].reshape(-1, 3), by_hand, rtol=1e-5, atol=1e-5)


def test_causal_stat_rows_groups_take_per_position_statistics_over_their_rows():
    bn = CausalBatchNorm(3, positions=8, weight=False, bias=False, stat_rows=2)
    x = torch.randn(4, 5, 3) * 3 + 1
    y = bn(x)
    for g in range(2):
        group = x[2 * g : 2 * g + 2]  # (2, T, d): statistics per position over the group's 2 rows
        by_hand = (group - group.mean(0)) / torch.sqrt(group.var(0, unbiased=False) + 1e-5)
        torch.testing.assert_close(y[2 * g : 2 * g + 2], by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_per_step_running_statistics_move_once_toward_the_mean_of_the_step_groups(causal):
    bn = build_norm(NormConfig(name="batch", causal=causal, momentum=0.3, stat_rows=2), 4, positions=6)
    bn.per_step = True
    micro = [torch.randn(4, 6, 4) * 2 + 1 for _ in range(3)]
    for x in micro:
        bn(x)
    assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))  # nothing moves before the step ends
    bn.advance_running_statistics()
    groups = torch.cat(micro).view(6, 2, 6, 4)  # the step's 6 groups of 2 sequences
    if causal:
        mean, var = groups.mean(1).mean(0), groups.var(1, unbiased=True).mean(0)
    else:
        flat = groups.reshape(6, 12, 4)
        mean, var = flat.mean(1).mean(0), flat.var(1, unbiased=True).mean(0)
    torch.testing.assert_close(bn.running_mean, 0.3 * mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, 0.7 + 0.3 * var, rtol=1e-5, atol=1e-6)
    assert bn.num_batches_tracked.item() == 1
    assert "step_mean_sum" not in bn.state_dict()  # zero between steps: not checkpointed


def test_without_the_loop_each_forward_is_a_step_as_in_torch():
    ours, ref = BatchNorm(4, momentum=0.2), nn.BatchNorm1d(4, momentum=0.2)
    for _ in range(3):
        x = torch.randn(3, 5, 4)
        ours(x), ref(x.reshape(-1, 4))
    torch.testing.assert_close(ours.running_var, ref.running_var)
    assert ours.num_batches_tracked.item() == 3


@pytest.mark.parametrize("stat_rows,message", [(3, "must divide the micro-batch of 8 sequences"), (0, "must divide")])
def test_stat_rows_must_divide_the_micro_batch(stat_rows, message):
    cfg = tiny_config("batch")
    cfg.norm.stat_rows = stat_rows
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_stat_rows_is_a_batch_norm_knob_only():
    cfg = tiny_config("layer")
    cfg.norm.stat_rows = 2
    with pytest.raises(ConfigError, match="norm=layer has no knob 'stat_rows'"):
        cfg.validate()


def test_causal_stat_rows_of_one_sequence_is_refused():
    cfg = tiny_config("batch")
    cfg.norm.causal, cfg.norm.stat_rows = True, 1
    with pytest.raises(ConfigError, match="per position, over the groups of norm.stat_rows=1 sequences"):
        cfg.validate()


def test_the_twins_script_measures_twin_runs_that_agree(tmp_path, text_data, monkeypatch, capsys, one_thread):
    """scripts/repro/batchnorm_twins.py, one placement, 2 steps: each row holds three computed differences,
    all small (the twins are the same model up to rounding). Run as __main__ in this process (a fresh Python
    would import torch again, seconds of CPU); one_thread restores the thread count it sets."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "repro" / "batchnorm_twins.py"
    args = ["--steps", "2", "--placements", "pre", "--text", text_data.files[0]]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    capsys.readouterr()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit:
        assert not exit.code, capsys.readouterr().err[-3000:]
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("pre ")]
    assert [" ".join(r[1:-3]) for r in rows] == ["packed vs unpacked", "grad_accum 1 vs 4"]
    assert all(0 <= float(x) < 1e-5 for r in rows for x in r[-3:])
