"""normlab: normalization ablations for GPT-style transformers."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("normlab")  # pyproject.toml's, as installed: the one source of the version
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"
