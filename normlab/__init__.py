"""normlab: normalization ablations for GPT-style transformers.

The command line (`normlab train`, `normlab compare`, `normlab sample`) is the main way in. From Python (a
notebook, a script), the same run and the same comparison:

    from normlab import RunConfig, train_run, load_runs, compare

    summary = train_run(RunConfig.from_dict({"norm": {"name": "rms"}, "max_steps": 200}), "runs/rms")
    table = [{**run.settings, **run.summary} for run in load_runs("outputs/sweeps/")]  # one row per run dir
    report_dir = compare(["outputs/sweeps/"])
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("normlab")  # pyproject.toml's, as installed: the one source of the version
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

__all__ = ["RunConfig", "train_run", "load_runs", "compare", "__version__"]

# The public names and the modules that define them. They load on first use, so that `import normlab` (which
# every `normlab ...` command does first) stays free of torch and matplotlib: `normlab --help` answers at once.
_PUBLIC = {
    "RunConfig": ("normlab.config", "RunConfig"),
    "train_run": ("normlab.train.api", "train_run"),
    "load_runs": ("normlab.analysis", "load_runs"),
    "compare": ("normlab.analysis.compare", "compare"),
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'normlab' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
