"""Print what one checkpoint costs: file size, atomic save time, and load + restore time.

    python scripts/checkpoint_cost.py [small|tiny|medium] [repeats]

Builds the model, AdamW (with its moment buffers filled by one step) and the rest of the loop's
state exactly as `_fit` registers them, then times Checkpointer.save and Checkpoint.load + restore
into a fresh copy, in a temporary directory.
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from normlab.checkpoint import Checkpoint, Checkpointer, GeneratorState
from normlab.config import RunConfig
from normlab.model import GPT
from normlab.train import DivergenceGuard, param_groups


def build(cfg):
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
    optimizer.step()
    guard = DivergenceGuard(3.0, torch.device("cpu"))
    guard.observe(0, torch.tensor(5.0))
    return {
        "model": model,
        "optimizer": optimizer,
        "scaler": torch.amp.GradScaler("cpu", enabled=False),
        "data_sampler": GeneratorState(torch.Generator().manual_seed(0)),
        "divergence_guard": guard,
    }


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    conf = Path(__file__).resolve().parent.parent / "conf" / "model" / f"{preset}.yaml"
    raw = yaml.safe_load(conf.read_text())
    # The preset's keys at the top level too: tiny sets seq_len below the default, to fit its context.
    cfg = RunConfig.from_dict({key: raw[key] for key in ("depth", "seq_len", "model") if key in raw})
    components = build(cfg)
    loop = dict(tokens=0, best_val=5.0, last_val=5.0, train_time=1.0, window_tokens=0, window_time=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        writer = Checkpointer(tmp, cfg, wandb_run_id="x", corpus_sha256="0" * 64)
        saves, loads = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            path = writer.save(i + 1, components, loop)
            saves.append(time.perf_counter() - t0)
            fresh = build(cfg)
            t0 = time.perf_counter()
            Checkpoint.load(path).restore(fresh)
            loads.append(time.perf_counter() - t0)
        size = path.stat().st_size
    n_params = sum(p.numel() for p in components["model"].parameters())
    print(f"model={preset} depth={cfg.depth} d_model={cfg.model.d_model} params={n_params:,}")
    print(f"checkpoint size: {size / 2**20:.2f} MiB")
    print(f"save (write, fsync, rename): median {sorted(saves)[len(saves) // 2] * 1e3:.1f} ms over {repeats}")
    print(f"load + restore: median {sorted(loads)[len(loads) // 2] * 1e3:.1f} ms over {repeats}")


if __name__ == "__main__":
    main()
