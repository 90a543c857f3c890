"""What every sweep job imports, imported by importing this module: the CPU workers' forkserver's preload
(normlab.launch.workers), so each forked worker starts with them imported once, not again.

Importing it starts no Python thread and none of torch's thread pools (checked on the CPU, whose workers alone are
forked): a process forked after it is as fresh as a spawned one that imported the same. wandb comes first: its
import walks the modules loaded before it, fewer before torch's. Then it exempts everything alive from later
garbage collections (gc.freeze, without a collection first: 0.2 s for the few objects the imports left): a forked
worker's collections walk none of it, nor touch (and so copy) its pages.
"""

from __future__ import annotations

import gc

try:  # the wandb sink's, for wandb.mode online or offline (the default)
    import wandb  # noqa: F401
    import wandb.sdk.launch.inputs.internal  # noqa: F401  (each wandb.init imports it to look for staged job inputs)
except ImportError:
    pass
try:  # wandb.Table imports it to ask whether a run's table is a DataFrame
    import pandas  # noqa: F401
except ImportError:
    pass

import torch  # noqa: F401  (seconds)
import torch._dynamo  # noqa: F401  (a second: the optimizer's first call imports it)

import normlab.analysis.render.heatmap  # noqa: F401  (matplotlib, for the end-of-run heatmaps)
import normlab.launch.task  # noqa: F401
import normlab.train.pack  # noqa: F401
import normlab.train.run  # noqa: F401

gc.freeze()
