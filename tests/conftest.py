import os

import pytest

# Tests never reach the network or a wandb account.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
# Tiny models gain nothing from a second thread, and on a shared CPU extra threads oversubscribe it
# (a tiny step went from ~4 ms to ~900 ms under load). Subprocesses inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from normlab.config import NORMS, PLACEMENTS, ConfigError, DataConfig, ModelConfig, NormConfig, RunConfig  # noqa: E402


def tiny_config(norm: str = "layer", placement: str = "pre", **overrides) -> RunConfig:
    """A RunConfig for a 2-block, 32-wide model that trains in well under a second per step."""
    cfg = RunConfig(
        norm=NormConfig(name=norm),
        lr=1e-3,  # the tests' own lr, apart from the default (3e-3): their pinned figures were measured at it
        placement=placement,
        depth=2,
        model=ModelConfig(d_model=32, n_head=2, context=32),
        batch_size=8,
        seq_len=16,
        max_steps=4,
        eval_every=2,
        eval_batches=2,
        log_every=1,
        progress=False,
        device="cpu",  # tests that mean the CPU say so: on a GPU machine `auto` picks CUDA
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg.validate()
    return cfg


def one_error_line(stderr: str, *words: str) -> str:
    """The one line a refused command printed (normlab's `normlab: error: ...`, no traceback), holding each of
    `words`."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("normlab: error: "), stderr[-3000:]
    assert "Traceback" not in stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _valid(norm: str, placement: str) -> bool:
    try:
        tiny_config(norm, placement)
    except ConfigError:
        return False
    return True


# Every norm × placement that validation accepts (placement=deepnorm with norm=none is refused, for one).
VALID_ARMS = [(n, p) for n in NORMS for p in PLACEMENTS if _valid(n, p)]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(items):
    """The tests that share a module-scoped fixture run in one xdist worker, so the fixture is built once, not
    once per worker (under --dist loadgroup every other test is its own unit, dealt to either worker). A test
    already in a group (the SLURM cluster's, the GPU's) stays in it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None or not hasattr(item, "_fixtureinfo"):
            continue
        shared = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                        if defs and defs[-1].scope == "module")
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{','.join(shared)}"))


@pytest.fixture
def one_thread():
    """One torch thread for the test, whatever OMP_NUM_THREADS says (bit-exact comparisons need it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Token caches go to one temp dir for the test run, never to ~/.cache."""
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def text_data(tmp_path):
    """A small local corpus (about 40 kB of varied bytes), cached under tmp_path."""
    rng = torch.Generator().manual_seed(0)
    words = ["norm", "layer", "residual", "gradient", "attention", "block", "stream", "(x)", "\n", "= 0.5;"]
    picks = torch.randint(0, len(words), (8000,), generator=rng).tolist()
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(words[i] for i in picks))
    return DataConfig(source="text", files=[str(path)], cache_dir=str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _loggers_as_they_were():
    """Handlers an in-process command added (Hydra's job logging puts console handlers on the root logger, bound
    to the sys.stdout of that moment: a test's captured stream, closed after it) are removed after the test,
    so a later test's log line is not a '--- Logging error ---' on a closed stream."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("normlab")]
    before = [list(logger.handlers) for logger in loggers]
    yield
    for logger, handlers in zip(loggers, before):
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)
