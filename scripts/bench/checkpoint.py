"""Print what one checkpoint costs: file size, atomic save time, and load + restore time.

    python scripts/bench/checkpoint.py [small|tiny|medium] [repeats]

Builds the TrainState as the loop does (AdamW's moment buffers filled by one step) and the
divergence guard, then times Checkpointer.save and Checkpoint.load + restore into a fresh copy,
in a temporary directory.
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from normlab.train.callbacks import DivergenceGuard
from normlab.train.checkpoint import Checkpoint, Checkpointer
from normlab.config import RunConfig
from normlab.train.run import build_state


def build(cfg):
    """The train state after one update, and the divergence guard."""
    state = build_state(cfg, torch.device("cpu"), "fp32")
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(state.model(x).reshape(-1, 256), x.reshape(-1)).backward()
    state.optimizer.step()
    guard = DivergenceGuard(3.0, torch.device("cpu"))
    guard.observe(0, torch.tensor(5.0))
    return state, [guard]


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{preset}.yaml"
    raw = yaml.safe_load(conf.read_text())
    # The preset's keys at the top level too: tiny sets seq_len below the default, to fit its context.
    cfg = RunConfig.from_dict({key: raw[key] for key in ("depth", "seq_len", "model") if key in raw})
    cfg.model.vocab_size = cfg.model.vocab_size or 256  # the presets follow the tokenizer: the byte one's here
    state, callbacks = build(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        writer = Checkpointer(tmp, cfg, wandb_run_id="x", corpus_sha256="0" * 64)
        saves, loads = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            state.step = i + 1
            path = writer.save(state, callbacks)
            saves.append(time.perf_counter() - t0)
            fresh, fresh_callbacks = build(cfg)
            t0 = time.perf_counter()
            Checkpoint.load(path).restore(fresh, fresh_callbacks)
            loads.append(time.perf_counter() - t0)
        size = path.stat().st_size
    n_params = sum(p.numel() for p in state.model.parameters())
    print(f"model={preset} depth={cfg.depth} d_model={cfg.model.d_model} params={n_params:,}")
    print(f"checkpoint size: {size / 2**20:.2f} MiB")
    print(f"save (write, fsync, rename): median {sorted(saves)[len(saves) // 2] * 1e3:.1f} ms over {repeats}")
    print(f"load + restore: median {sorted(loads)[len(loads) // 2] * 1e3:.1f} ms over {repeats}")


if __name__ == "__main__":
    main()
