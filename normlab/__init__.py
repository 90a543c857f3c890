"""normlab: normalization ablations for GPT-style transformers."""

__version__ = "0.1.0"
