"""Per-layer telemetry: hand-computed values, grad_accum invariance, no effect on training, every key in every arm."""

import json
import math

import pytest
import torch
from torch import nn

from conftest import VALID_ARMS, tiny_config
from test_pack import ABSOLUTE_SCALE
from normlab.config import ConfigError, RunConfig, TelemetryConfig
from normlab.data import load_corpus, sample_batch
from normlab.nn.model import GPT
from normlab.train.sinks import MetricsFile, RunDir
from normlab.keys import layer_label
from normlab.telemetry.probe import PROBE_SEQS, Probe
from normlab.telemetry.stats import attention_stats
from normlab.train.loop import loss_fn
from normlab.train.optim import lr_at, param_groups
from normlab.train.run import train
from normlab.train.runtime import seed_everything

TELEMETRY_FAMILIES = ("act/", "grad/resid_rms/", "grad/norm/", "grad/embed", "grad/norm_f", "update_ratio/", "norm/", "attn/",
                      "out/")



def run(cfg: RunConfig, tmp_path, name: str = "run") -> list[dict]:
    """Train `cfg` with wandb off; return the records of metrics.jsonl."""
    cfg.wandb.mode = "disabled"
    run_dir = RunDir(tmp_path / name)
    train(cfg, run_dir, sinks=[MetricsFile(run_dir)])
    return [json.loads(line) for line in run_dir.metrics_path.read_text().splitlines()]


def telemetry_keys(record: dict) -> set[str]:
    return {k for k in record if k.startswith(TELEMETRY_FAMILIES)}


def rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def l2(tensors) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in tensors))


# ---------------------------------------------------------------- schedule and config


def test_active_steps_are_zero_every_n_and_the_last():
    model = GPT(tiny_config())
    assert [s for s in range(8) if Probe(model, every=3, max_steps=8).active(s)] == [0, 3, 6, 7]
    assert [s for s in range(8) if Probe(model, every=0, max_steps=8).active(s)] == []


def test_telemetry_steps_are_logged_even_between_log_steps(tmp_path, text_data):
    cfg = tiny_config(data=text_data, max_steps=7, log_every=100, eval_every=0, telemetry=TelemetryConfig(every=3))
    records = run(cfg, tmp_path)
    with_telemetry = [r["step"] for r in records if "act/resid_rms/L00" in r]
    assert with_telemetry == [0, 3, 6]  # 6 is also the last training step
    for r in records:
        if r["step"] in with_telemetry:
            assert "loss" in r and "grad_norm" in r  # the loop's own keys stay in the same record


def test_negative_interval_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match=r"^telemetry.every=-1: must be an integer >= 0"):
        RunConfig.from_dict({"telemetry": {"every": -1}})
    assert RunConfig.from_dict({"telemetry": {"every": 0}}).telemetry.every == 0


def test_packaged_config_sets_the_schema_default():
    from hydra import compose, initialize_config_module

    from normlab.launch.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_module(config_module="normlab.conf", version_base="1.3"):
        cfg = compose(config_name="config")
    assert cfg.telemetry.every == TelemetryConfig().every > 0


def test_layer_labels_are_zero_padded_to_one_width():
    assert layer_label(3, 4) == "L03"
    assert [layer_label(i, 120) for i in (0, 7, 119)] == ["L000", "L007", "L119"]


# ---------------------------------------------------------------- values by hand


def attention_by_hand(q: torch.Tensor, k: torch.Tensor) -> tuple[float, float]:
    """Max logit and mean entropy, one query row at a time over its visible keys."""
    q, k = q.double(), k.double()
    B, H, T, D = q.shape
    logit_max, entropies = -math.inf, []
    for b in range(B):
        for h in range(H):
            for t in range(T):
                logits = (k[b, h, : t + 1] @ q[b, h, t]) / math.sqrt(D)
                logit_max = max(logit_max, logits.max().item())
                p = torch.softmax(logits, dim=0)
                entropies.append(-(p * p.log()).sum().item())
    return logit_max, sum(entropies) / len(entropies)


def head_entropies_by_hand(q: torch.Tensor, k: torch.Tensor) -> list[float]:
    """Each head's attention entropy, averaged over sequences and query rows, one row at a time."""
    q, k = q.double(), k.double()
    B, H, T, D = q.shape
    means = []
    for h in range(H):
        entropies = []
        for b in range(B):
            for t in range(T):
                p = torch.softmax((k[b, h, : t + 1] @ q[b, h, t]) / math.sqrt(D), dim=0)
                entropies.append(-(p * p.log()).sum().item())
        means.append(sum(entropies) / len(entropies))
    return means


def test_attention_stats_match_a_row_by_row_computation():
    torch.manual_seed(0)
    q, k = 3 * torch.randn(2, 3, 9, 4), 3 * torch.randn(2, 3, 9, 4)
    logit_max, head_sums = attention_stats(q, k)
    want_max, want_entropy = attention_by_hand(q, k)
    assert logit_max.item() == pytest.approx(want_max, rel=1e-5)
    assert head_sums.shape == (3,)  # per head, summed over the 2 sequences
    assert head_sums.tolist() == pytest.approx([2 * e for e in head_entropies_by_hand(q, k)], rel=1e-5)
    assert head_sums.sum().item() / (2 * 3) == pytest.approx(want_entropy, rel=1e-5)
    # Uniform attention over t+1 keys has entropy ln(t+1): a check independent of both computations.
    _, uniform = attention_stats(torch.zeros(1, 1, 9, 4), torch.zeros(1, 1, 9, 4))
    assert uniform.item() == pytest.approx(sum(math.log(t + 1) for t in range(9)) / 9, rel=1e-6)


@pytest.mark.parametrize("norm,placement", [("layer", "pre"), ("rms", "post")])
def test_step_zero_statistics_equal_a_manual_step(tmp_path, text_data, norm, placement):
    """The logged values at step 0 against a forward/backward/AdamW step done by hand on the same batch."""
    cfg = tiny_config(norm, placement, data=text_data, max_steps=2, telemetry=TelemetryConfig(every=1))
    logged = run(cfg, tmp_path)[0]
    assert logged["step"] == 0

    # The loop's state at step 0: same seed, same model, same first batch.
    seed_everything(cfg.seed)
    model = GPT(cfg).train()
    x, y = sample_batch(load_corpus(cfg.data).train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
    stream = model.tok_emb(x) + model.pos_emb(torch.arange(cfg.seq_len))
    stream.retain_grad()
    embed, outs, norm_io, resid, qk = stream, {}, {}, [], []
    for i, block in enumerate(model.blocks):
        label = f"L{i:02d}"
        h = stream
        for slot, f, part in ((block.norm1, block.attn, "attn"), (block.norm2, block.mlp, "mlp")):
            inner = slot(h) if placement == "pre" else h
            if placement == "pre":
                norm_io[f"{label}/{'norm1' if part == 'attn' else 'norm2'}"] = (h, inner)
            if part == "attn":
                qk.append(f.heads(inner[:PROBE_SEQS]))
            outs[f"{label}/{part}"] = f(inner)
            h = h + outs[f"{label}/{part}"]
            if placement == "post":
                normed = slot(h)
                norm_io[f"{label}/{'norm1' if part == 'attn' else 'norm2'}"] = (h, normed)
                h = normed
        h.retain_grad()
        resid.append(h)
        stream = h
    final = model.norm_f(stream)
    if placement == "pre":
        norm_io["norm_f"] = (stream, final)
    loss = loss_fn(model.head(final), y)
    loss.backward()
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-6)

    expected = {"act/embed_rms": rms(embed), "act/embed_max": embed.abs().max().item(), "grad/embed_rms": rms(embed.grad)}
    for i, (block, h) in enumerate(zip(model.blocks, resid)):
        label = f"L{i:02d}"
        expected[f"act/resid_rms/{label}"] = rms(h)
        expected[f"act/resid_max/{label}"] = h.abs().max().item()
        expected[f"grad/resid_rms/{label}"] = rms(h.grad)
        expected[f"grad/norm/{label}"] = l2(p.grad for p in (*block.attn.parameters(), *block.mlp.parameters()))
        expected[f"grad/norm/{label}/attn"] = l2(p.grad for p in block.attn.parameters())
        expected[f"grad/norm/{label}/mlp"] = l2(p.grad for p in block.mlp.parameters())
        expected[f"grad/norm/{label}/norms"] = l2(p.grad for n in (block.norm1, block.norm2) for p in n.parameters())
        for part in ("attn", "mlp"):
            expected[f"act/out_rms/{label}/{part}"] = rms(outs[f"{label}/{part}"])
        expected[f"attn/logit_max/{label}"], expected[f"attn/entropy/{label}"] = attention_by_hand(*qk[i][:2])
    for loc, (inp, out) in norm_io.items():
        expected[f"act/norm_in_rms/{loc}"] = rms(inp)
        expected[f"act/norm_out_rms/{loc}"] = rms(out)
    expected["grad/embed_norm"] = l2([model.tok_emb.weight.grad, model.pos_emb.weight.grad])

    # The optimizer step, as the loop takes it: clip, then AdamW at step 0's learning rate.
    groups = {
        # a whole block's update ratio is over its sublayers' weights, its norm gains left out
        **{f"L{i:02d}": [*b.attn.parameters(), *b.mlp.parameters()] for i, b in enumerate(model.blocks)},
        **{f"L{i:02d}/mlp": list(b.mlp.parameters()) for i, b in enumerate(model.blocks)},
        "embed": [model.tok_emb.weight, model.pos_emb.weight],
    }
    before = {loc: [p.detach().clone() for p in ps] for loc, ps in groups.items()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.optim.weight_decay), lr=lr_at(0, cfg), betas=tuple(cfg.optim.betas), eps=cfg.optim.eps
    )
    optimizer.step()
    for loc, ps in groups.items():
        expected[f"update_ratio/{loc}"] = l2(p - b for p, b in zip(ps, before[loc])) / l2(before[loc])

    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-9), key


def test_norm_parameter_statistics_are_generic():
    """Gain mean/std of any norm's `weight` or `g`, DyT's `alpha`, and BatchNorm's mean running variance."""

    class ScalarGainNorm(nn.Module):  # stands in for ScaleNorm (g) and DyT (alpha) before they land
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.tensor(2.5))
            self.alpha = nn.Parameter(torch.tensor(0.8))

        def forward(self, x):
            return self.g * torch.tanh(self.alpha * x)

    torch.manual_seed(0)
    model = GPT(tiny_config("batch", "pre"))
    block = model.blocks[1]
    with torch.no_grad():
        block.norm1.weight.copy_(torch.randn(32))
        block.norm2.running_var.uniform_(0.5, 3.0)
    block.norm1_out = ScalarGainNorm()
    probe = Probe(model, every=1, max_steps=1)
    probe.forward(torch.randint(0, 256, (2, 16))).sum().backward()
    probe.measure_gradients(torch.amp.GradScaler("cpu", enabled=False))
    probe.before_update()
    stats = probe.collect()
    w = block.norm1.weight.detach()
    assert stats["norm/gain_mean/L01/norm1"] == pytest.approx(w.mean().item(), rel=1e-6)
    assert stats["norm/gain_std/L01/norm1"] == pytest.approx(w.std(correction=0).item(), rel=1e-6)
    assert stats["norm/running_var/L01/norm2"] == pytest.approx(block.norm2.running_var.mean().item(), rel=1e-6)
    assert stats["norm/gain_mean/L01/norm1_out"] == pytest.approx(2.5)
    assert stats["norm/gain_std/L01/norm1_out"] == 0.0
    assert stats["norm/alpha/L01/norm1_out"] == pytest.approx(0.8)
    assert "act/norm_in_rms/L01/norm1_out" in stats and "act/norm_in_rms/L00/norm1_out" not in stats


# ---------------------------------------------------------------- invariances


def test_grad_accum_4_logs_the_same_statistics_as_1(tmp_path, text_data):
    """Batch 16 in micro-batches of 4: the attention statistics' 8 sequences span two micro-batches."""
    logged = {}
    for accum in (1, 4):
        cfg = tiny_config("rms", "pre", data=text_data, batch_size=16, grad_accum=accum, max_steps=1,
                          telemetry=TelemetryConfig(every=1))
        logged[accum] = run(cfg, tmp_path, f"accum{accum}")[0]
    one, four = logged[1], logged[4]
    compared = telemetry_keys(one)
    assert compared == telemetry_keys(four)
    assert {"attn/logit_max/L00", "attn/entropy/L01", "grad/resid_rms/L00", "grad/norm/L01"} <= compared
    for key in compared:
        scale = next((v for k, v in ABSOLUTE_SCALE.items() if key.startswith(k)), 0.0)  # cosines, angles: see test_pack
        assert four[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5 * scale), key
    assert four["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("norm,placement", [("layer", "pre"), ("batch", "post")])
def test_telemetry_does_not_change_the_trajectory(tmp_path, text_data, norm, placement):
    losses = {}
    for every in (0, 1):
        cfg = tiny_config(norm, placement, data=text_data, max_steps=5, telemetry=TelemetryConfig(every=every))
        records = run(cfg, tmp_path, f"every{every}")
        assert bool(telemetry_keys(records[0])) == (every > 0)
        losses[every] = [(r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm")) for r in records]
    assert losses[0] == losses[1]


def test_collect_sees_only_the_probes_passes():
    """A forward and backward outside the Probe's forward adds nothing to what collect() returns but the
    parameters' gradient norms that measure_gradients takes."""
    model = GPT(tiny_config("layer", "pre"))
    probe = Probe(model, every=2, max_steps=10)
    idx = torch.randint(0, 256, (2, 16))
    probe.forward(idx).sum().backward()
    stats = probe.collect()
    assert "act/resid_rms/L00" in stats and "grad/resid_rms/L01" in stats
    model(idx).sum().backward()
    probe.measure_gradients(torch.amp.GradScaler("cpu", enabled=False))
    assert set(probe.collect()) == {"grad/embed_norm", "grad/norm_f_norm", *(f"grad/norm/L0{i}{part}" for i in range(2)
                                    for part in ("", "/attn", "/mlp", "/norms"))}
    assert probe.collect() == {}


def test_a_probe_in_cuda_graphs_keeps_its_statistics_out_of_the_graphs_memory():
    """In CUDA graphs (Probe(graphs=True)) a replay's outputs are overwritten by the next micro-batch's replay: the
    Probe copies each forward's statistics out and keeps the collectors' gradients in memory of its own, which each
    backward adds into. Those steps, taken here around the eager forward (no CUDA), give the plain Probe's
    statistics exactly, over two steps of two micro-batches each."""
    stats = []
    for graphs in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny_config("rms", "pre"))
        probe = Probe(model, every=1, max_steps=2)
        probe._graphs = graphs  # the graphs' bookkeeping without compiling (torch.compile's CUDA graphs need CUDA)
        probe._reset()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(2):
                (probe.forward(torch.randint(0, 256, (4, 16), generator=batches)).float().mean() / 2).backward()
            probe.measure_gradients(torch.amp.GradScaler("cpu", enabled=False))
            probe.before_update()
            optimizer.step()
            optimizer.zero_grad()
            stats.append(probe.collect())
    assert stats[0]["grad/resid_rms/L01"] > 0 and stats[0] != stats[1]
    assert stats[2:] == stats[:2]


def test_fp16_stream_gradients_are_unscaled(tmp_path, text_data):
    """Under fp16 the GradScaler's scale (65536 at first) is in the hooked gradients; the logged RMS has it divided out."""
    logged = {}
    for precision in ("fp32", "fp16"):
        cfg = tiny_config("layer", "pre", data=text_data, precision=precision, device="cpu", max_steps=1)
        cfg.telemetry = TelemetryConfig(every=1)
        logged[precision] = run(cfg, tmp_path, precision)[0]
    for key in ("grad/resid_rms/L00", "grad/resid_rms/L01", "grad/embed_rms", "grad/norm/L01"):
        assert logged["fp16"][key] == pytest.approx(logged["fp32"][key], rel=0.05), key


# ---------------------------------------------------------------- every arm, every key


def expected_keys(model: GPT) -> set[str]:
    """The statistics each block, the embedding and the final norm should report, from the model's structure."""
    keys = {"act/embed_rms", "act/embed_max", "grad/embed_rms", "grad/embed_norm", "update_ratio/embed", "out/logz"}

    def norm_keys(loc: str, norm: nn.Module) -> set[str]:
        names = {n for n, _ in norm.named_parameters()}
        out = {f"act/norm_in_rms/{loc}", f"act/norm_out_rms/{loc}"}
        if names & {"weight", "g"}:
            out |= {f"norm/gain_mean/{loc}", f"norm/gain_std/{loc}"}
        if "alpha" in names:
            out.add(f"norm/alpha/{loc}")
        if "shift" in names:
            out.add(f"norm/shift/{loc}")
        if norm.eps_rms() is not None:
            out.add(f"norm/eps_ratio/{loc}")
        if hasattr(norm, "running_var"):
            out.add(f"norm/running_var/{loc}")
        return out

    for i, block in enumerate(model.blocks):
        L = f"L{i:02d}"
        keys |= {f"act/resid_rms/{L}", f"act/resid_max/{L}", f"grad/resid_rms/{L}", f"attn/logit_max/{L}", f"attn/entropy/{L}"}
        stream_stats = ("block_angle", "block_angle_last", "token_cos", "kurtosis", "max_median", "max_median_max", "top_median",
                        "top_median_max")
        keys |= {f"act/{stat}/{L}" for stat in stream_stats}
        keys.add(f"attn/entropy_min/{L}")
        for part in ("attn", "mlp"):
            keys |= {f"act/out_rms/{L}/{part}", f"grad/norm/{L}/{part}", f"update_ratio/{L}/{part}"}
        keys |= {f"grad/norm/{L}", f"update_ratio/{L}"}
        norms = {n: m for n, m in block.named_children() if n.startswith("norm") and not isinstance(m, nn.Identity)}
        norms |= {n: getattr(block.attn, n) for n in ("q_norm", "k_norm") if not isinstance(getattr(block.attn, n), nn.Identity)}
        for name, norm in norms.items():
            keys |= norm_keys(f"{L}/{name}", norm)
        if any(True for n in norms.values() for _ in n.parameters()):
            keys |= {f"grad/norm/{L}/norms", f"update_ratio/{L}/norms"}
    if not isinstance(model.norm_embed, nn.Identity):
        keys |= norm_keys("norm_embed", model.norm_embed) | {"grad/norm_embed_norm", "update_ratio/norm_embed"}
    if not isinstance(model.norm_f, nn.Identity):
        keys |= norm_keys("norm_f", model.norm_f)
        if any(True for _ in model.norm_f.parameters()):
            keys |= {"grad/norm_f_norm", "update_ratio/norm_f"}
    return keys


@pytest.mark.parametrize("norm, placement", VALID_ARMS)
def test_every_norm_and_placement_logs_every_key_for_every_layer(tmp_path, text_data, norm, placement):
    cfg = tiny_config(norm, placement, data=text_data, max_steps=1, eval_every=0, telemetry=TelemetryConfig(every=1))
    record = run(cfg, tmp_path)[0]
    assert record["step"] == 0
    logged = telemetry_keys(record)
    assert logged == expected_keys(GPT(cfg))
    per_layer = [{k.replace(f"/L{i:02d}", "/L") for k in logged if f"/L{i:02d}" in k} for i in range(cfg.depth)]
    assert all(keys == per_layer[0] for keys in per_layer) and len(per_layer[0]) >= 13
    bad = {k: record[k] for k in logged if not (isinstance(record[k], float) and math.isfinite(record[k]))}
    assert bad == {}


# ---------------------------------------------------------------- end-of-run products


def test_run_dir_gets_the_layer_table_and_heatmaps(tmp_path, text_data):
    cfg = tiny_config("layer", "post", data=text_data, max_steps=5, telemetry=TelemetryConfig(every=2))
    records = run(cfg, tmp_path)
    run_dir = tmp_path / "run" / "telemetry"
    lines = (run_dir / "layers.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [line.split(",") for line in lines[1:]]
    assert header[:2] == ["step", "layer"] and "act/resid_rms" in header and "grad/norm/mlp" in header
    assert [(r[0], r[1]) for r in rows] == [(s, L) for s in ("0", "2", "4") for L in ("L00", "L01")]
    by_step = {r["step"]: r for r in records}
    col = header.index("grad/resid_rms")
    for r in rows:
        assert float(r[col]) == by_step[int(r[0])][f"grad/resid_rms/{r[1]}"]
    for name in ("resid_rms", "grad_norm"):
        assert (run_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_products_when_telemetry_is_off(tmp_path, text_data):
    run(tiny_config(data=text_data, max_steps=2, telemetry=TelemetryConfig(every=0)), tmp_path)
    assert not (tmp_path / "run" / "telemetry").exists()


def test_wandb_gets_the_table_and_images_at_the_last_step(tmp_path, text_data):
    cfg = tiny_config("rms", "pre", data=text_data, max_steps=3, telemetry=TelemetryConfig(every=2))
    cfg.wandb.mode = "offline"
    train(cfg, tmp_path / "run")
    media = next((tmp_path / "run" / "wandb").glob("offline-run-*")) / "files" / "media"
    tables = list((media / "table" / "telemetry").glob("layers_*.table.json"))
    images = sorted(p.name.rsplit("_", 1)[0] for p in (media / "images" / "telemetry").glob("*.png"))
    assert images == ["grad_norm_3", "resid_rms_3"]  # logged at the final step, 3
    table = json.loads(tables[0].read_text())
    assert table["columns"][:2] == ["step", "layer"] and len(table["data"]) == 2 * cfg.depth  # steps 0 and 2 (the last)



def test_a_resumed_run_keeps_the_telemetry_history(tmp_path, text_data):
    """The end-of-run table of a run preempted and resumed covers the steps before the checkpoint too."""
    import signal

    from normlab.train import preempt
    from normlab.train.sinks import MetricsFile, RunDir
    from test_checkpoint import SignalAt

    def cfg():
        c = tiny_config("layer", "pre", data=text_data, max_steps=6, eval_every=0, telemetry=TelemetryConfig(every=2))
        c.wandb.mode = "disabled"
        return c

    train(cfg(), tmp_path / "whole")
    run_dir = RunDir(tmp_path / "cut")
    with preempt.watch(), pytest.raises(preempt.Preempted):
        train(cfg(), run_dir, sinks=[MetricsFile(run_dir), SignalAt(2, signal.SIGTERM)])
    train(cfg(), run_dir)  # resume=auto picks up the checkpoint of step 4 (row 2 is written, and signals, in step 3)
    whole = (tmp_path / "whole" / "telemetry" / "layers.csv").read_text().splitlines()
    resumed = (tmp_path / "cut" / "telemetry" / "layers.csv").read_text().splitlines()
    assert [line.split(",")[:2] for line in resumed] == [line.split(",")[:2] for line in whole]
    assert {line.split(",")[0] for line in whole[1:]} == {"0", "2", "4", "5"}


def test_importing_the_probe_and_the_loop_does_not_import_matplotlib():
    """The probe measures and draws nothing; the heatmaps are rendered from the records at the end of a run."""
    import subprocess
    import sys

    code = "import sys, normlab.telemetry.probe, normlab.train.callbacks, normlab.train; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- QK-norm gains, block update ratio


def _probe_one_step(model: GPT, lr: float = 1e-2) -> dict[str, float]:
    """One watched forward, backward and AdamW step of `model` through a Probe; its statistics."""
    probe = Probe(model, every=1, max_steps=1)
    probe.forward(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))).mean().backward()
    probe.measure_gradients(torch.amp.GradScaler("cpu", enabled=False))
    probe.before_update()
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    return probe.collect()


def test_qk_norm_gains_are_logged_as_norms_and_their_gradients_counted_under_norms():
    torch.manual_seed(0)
    model = GPT(tiny_config("rms", "pre", qk_norm=True))
    attn = model.blocks[1].attn
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(0.5, 1.5, attn.q_norm.weight.numel()))
    stats = _probe_one_step(model)
    w = torch.linspace(0.5, 1.5, attn.q_norm.weight.numel())
    assert stats["norm/gain_mean/L01/q_norm"] == pytest.approx(w.mean().item(), rel=1e-6)
    assert stats["norm/gain_std/L01/q_norm"] == pytest.approx(w.std(correction=0).item(), rel=1e-6)
    assert stats["norm/gain_mean/L01/k_norm"] == pytest.approx(1.0)
    assert "act/norm_in_rms/L01/q_norm" in stats

    def l2(params) -> float:
        return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))

    block = model.blocks[1]
    assert stats["grad/norm/L01/attn"] == pytest.approx(l2([*attn.qkv.parameters(), *attn.proj.parameters()]), rel=1e-5)
    norms = [*block.norm1.parameters(), *block.norm2.parameters(), attn.q_norm.weight, attn.k_norm.weight]
    assert stats["grad/norm/L01/norms"] == pytest.approx(l2(norms), rel=1e-5)
    assert attn.q_norm.weight.grad.abs().sum() > 0  # the gains do get a gradient: the test could fail


def test_block_figures_leave_out_the_norm_gains_and_the_residual_gates():
    """grad/norm/L01 and update_ratio/L01 are over the attention's and the MLP's weights, with or without norms
    and gates; those have keys of their own."""
    ratios = {}
    for norm, gate in (("layer", "layerscale"), ("layer", "none"), ("none", "rezero")):
        torch.manual_seed(0)
        stats = _probe_one_step(GPT(tiny_config(norm, "pre", residual_gate=gate)))
        ratios[norm, gate] = stats
        attn, mlp = stats["update_ratio/L01/attn"], stats["update_ratio/L01/mlp"]
        assert min(attn, mlp) <= stats["update_ratio/L01"] <= max(attn, mlp)  # a mix of the two, nothing else
        grads = stats["grad/norm/L01/attn"], stats["grad/norm/L01/mlp"]
        assert stats["grad/norm/L01"] == pytest.approx(math.hypot(*grads), rel=1e-6)
        assert ("grad/norm/L01/gate1" in stats) == ("update_ratio/L01/gate2" in stats) == (gate != "none")
    assert ratios["layer", "none"]["update_ratio/L01/norms"] > 0 and "update_ratio/L01/norms" not in ratios["none", "rezero"]
    gated = ratios["layer", "layerscale"]
    assert gated["grad/norm/L01/gate1"] > 0 and gated["update_ratio/L01/gate2"] > 0
    assert math.isnan(ratios["none", "rezero"]["update_ratio/L01/gate1"])  # ReZero's gate starts at 0: no ratio


def test_fused_parameter_norms_equal_the_per_tensor_ones():
    from normlab.telemetry.stats import l2_norms

    gen = torch.Generator().manual_seed(0)
    model = GPT(tiny_config("rms", "pre"))
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 10 ** torch.randint(-4, 4, (), generator=gen).item()
    tensors = [p.grad for p in model.parameters()] + [None, torch.zeros(3)]
    want = torch.tensor([0.0 if t is None else torch.linalg.vector_norm(t, dtype=torch.float32).item() for t in tensors])
    torch.testing.assert_close(l2_norms(tensors), want, rtol=1e-6, atol=0)
