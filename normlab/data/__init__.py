"""Corpora: load a source once, cache its bytes and tokens, split, and sample windows.

sources (stdlib and text files), hf (Hugging Face datasets, offline detection), cache (the token cache
and its file format), corpus (load_corpus: split and tokenize), holdout (validation documents as they
come), pieces (text read a block at a time, in the pieces a tokenizer encodes), prepare (tokens encoded
in parallel into shards, resumably), shards (token shards on disk, windows across them), tokens
(data=tokens: shards made elsewhere), batches (windows, bits per byte), tokenizer (byte, BPE and
pretrained tokenizers).
"""

from normlab.data.batches import bits_per_byte, eval_batches, sample_batch, target_bytes
from normlab.data.corpus import Corpus, load_corpus, load_tokenizer, model_vocab_size
from normlab.data.errors import DataError
from normlab.data.shards import TokenShards
from normlab.data.sources import stdlib_files

__all__ = [
    "Corpus",
    "DataError",
    "TokenShards",
    "bits_per_byte",
    "eval_batches",
    "load_corpus",
    "load_tokenizer",
    "model_vocab_size",
    "sample_batch",
    "stdlib_files",
    "target_bytes",
]
