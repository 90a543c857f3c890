"""normlab uses torch and wandb as they ship: importing it and running a run (the wandb sink on) leaves their classes
and functions the same objects, and hangs nothing of normlab's on them. A user who imports normlab in a notebook
keeps the libraries they imported."""

import json
import os
import subprocess
import sys

# In a fresh interpreter: every class and function of the namespaces a run goes through, by identity, and whatever
# normlab objects hang on them (or on the functions their closures hold), before and after a one-step run.
FRESH = """
import json, sys, tempfile, types
import torch, torch.optim.adam, torch.optim.adamw, torch.nn.functional, wandb, wandb.util
import torch._dynamo  # which rebinds some of torch's functions itself (torch.manual_seed); an optimizer's step imports it

OWNERS = {"torch": torch, "torch.optim": torch.optim, "torch.optim.adam": sys.modules["torch.optim.adam"],
          "torch.optim.adamw": sys.modules["torch.optim.adamw"], "torch.optim.optimizer": sys.modules["torch.optim.optimizer"],
          "torch.nn.functional": torch.nn.functional, "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module,
          "torch.optim.Optimizer": torch.optim.Optimizer, "torch.optim.Adam": torch.optim.Adam,
          "torch.optim.AdamW": torch.optim.AdamW, "torch.amp.GradScaler": torch.amp.GradScaler,
          "wandb": wandb, "wandb.util": wandb.util, "wandb.Run": wandb.Run, "wandb.Table": wandb.Table,
          "wandb.Settings": wandb.Settings}
KINDS = (type, types.FunctionType, types.BuiltinFunctionType, staticmethod, classmethod, property)

def normlabs(value):
    fn = getattr(value, "__func__", value)
    if not isinstance(fn, types.FunctionType):
        return []
    held = [fn, *(c.cell_contents for c in fn.__closure__ or () if isinstance(getattr(c, "cell_contents", None), types.FunctionType))]
    return sorted(f"{f.__qualname__}.{k}" for f in held for k, v in vars(f).items()
                  if str(getattr(v, "__module__", "")).startswith("normlab"))

def snapshot():
    return {f"{name}.{attr}": [id(value), normlabs(value)] for name, owner in OWNERS.items()
            for attr, value in list(vars(owner).items()) if isinstance(value, KINDS)}

before = snapshot()
import normlab
from normlab.config import ModelConfig, RunConfig
from normlab.train.run import train

cfg = RunConfig(depth=1, model=ModelConfig(d_model=16, n_head=2, context=16), batch_size=2, seq_len=8, max_steps=1,
                eval_every=1, eval_batches=1, log_every=1, progress=False, device="cpu", sinks=["jsonl", "wandb"])
cfg.validate()
with tempfile.TemporaryDirectory() as run_dir:
    train(cfg, run_dir, echo=False)
after = snapshot()
print(json.dumps({"names": len(before), "replaced": sorted(k for k in before if after.get(k, [None])[0] != before[k][0]),
                  "normlab_on_them": sorted({m for k in after for m in after[k][1]})}))
"""


def test_a_run_leaves_torchs_and_wandbs_classes_and_functions_as_they_were(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["names"] > 500  # the namespaces were read (torch's alone holds hundreds)
    assert result["replaced"] == []
    assert result["normlab_on_them"] == []
