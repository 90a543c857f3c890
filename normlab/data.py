"""Byte-level corpora: load a source once, cache its tokens, split, and sample windows.

Tokenizer ("bytes-v1"): a token is one raw byte of the UTF-8 text, so the
vocabulary is exactly 256 and tokenizing is the identity on bytes. A corpus is
a sequence of documents (files or dataset rows) joined with a single b"\\n"
between consecutive documents (none before the first or after the last).

Sources (`DataConfig.source`):
  stdlib  every `.py` file of this interpreter's standard library
          (`sysconfig.get_paths()["stdlib"]`), recursively, in sorted relative
          POSIX-path order, skipping anything under a `site-packages` or
          `dist-packages` directory so the corpus never depends on what was
          pip-installed. Needs no network.
  text    the local files `DataConfig.files`, in the order given.
  hf      `datasets.load_dataset(name, config_name, split=split)`, column
          `text_field`, one document per row.

Split: the last `floor(n * val_fraction)` tokens are validation, the rest train.

Cache: the token stream of a source is written once and reused. The cache
directory is `DataConfig.cache_dir` if set, else `$NORMLAB_CACHE` if set, else
`~/.cache/normlab`. An entry is two files named after the source kind and a
key, a hash of the tokenizer, the separator and the source's identity:

    <kind>-<key>.bin    the raw token bytes (`sha256sum` of it equals meta's sha256)
    <kind>-<key>.json   {"key", "tokenizer", "source", "n_bytes", "sha256", "spec"}

The identity is cheap to compute without reading content: for stdlib and text
it lists each file's path, size and mtime_ns; for hf it is name, config, split,
column and the loaded dataset's fingerprint. Both files are written to a
temporary name in the same directory and moved into place with `os.replace`,
so concurrent jobs never see half an entry; on POSIX a lock file additionally
lets only one job build an entry while the others wait and then reuse it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import sysconfig
import tempfile
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from .config import ConfigError, DataConfig

try:
    import fcntl
except ImportError:  # not POSIX: atomic writes alone keep the cache consistent
    fcntl = None

log = logging.getLogger(__name__)

TOKENIZER = "bytes-v1"
VOCAB_SIZE = 256
SEPARATOR = b"\n"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
HUB_PROBE_TIMEOUT = 1.0  # seconds; a reachable hub answers a TCP handshake far faster
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


class DataError(RuntimeError):
    """A data source that cannot be loaded; message is one clear line."""


@dataclass(frozen=True, eq=False)
class Corpus:
    """A tokenized corpus split into a training head and a held-out tail."""

    train: torch.Tensor = field(repr=False)  # 1-D uint8 byte tokens
    val: torch.Tensor = field(repr=False)  # 1-D uint8, the tail of the token stream
    vocab_size: int
    source: str  # e.g. "stdlib:/usr/lib/python3.11", "text:a.txt,b.txt", "hf:name/split"
    n_bytes: int  # total tokens, train + val
    sha256: str  # hex sha256 of the whole token byte string


@dataclass(frozen=True)
class _Source:
    kind: str
    description: str
    spec: dict  # JSON-able identity of the content; hashed into the cache key
    documents: Callable[[], Iterable[bytes]]  # reads the content, only on a cache miss


def load_corpus(cfg: DataConfig) -> Corpus:
    """Tokenize the configured source (or reuse its cached tokens) and split off the validation tail.

    Raises DataError with a one-line message if the source cannot be read or is
    too small to split, and ConfigError for a val_fraction outside (0, 1).
    """
    if not 0.0 < cfg.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction}: must be between 0 and 1, exclusive")
    source = _resolve_source(cfg)
    tokens, meta = _cached_tokens(_cache_root(cfg), source)
    n = int(meta["n_bytes"])
    n_val = int(n * cfg.val_fraction)
    if n_val < 1 or n_val >= n:
        raise DataError(
            f"{source.description} has only {n} tokens: too few to split with data.val_fraction={cfg.val_fraction}"
        )
    return Corpus(
        train=torch.from_numpy(tokens[: n - n_val]),
        val=torch.from_numpy(tokens[n - n_val :]),
        vocab_size=VOCAB_SIZE,
        source=source.description,
        n_bytes=n,
        sha256=meta["sha256"],
    )


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `batch_size` random windows: x = tokens[s : s+seq_len], y = tokens[s+1 : s+seq_len+1].

    Starts are `torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)`,
    so the same generator state gives the same batch. Returns contiguous int64
    CPU tensors of shape (batch_size, seq_len). Raises DataError if `tokens`
    is not longer than `seq_len`.
    """
    n = tokens.numel()
    if n <= seq_len:
        raise DataError(
            f"a split of {n} tokens is too short for seq_len={seq_len}: "
            "use more data, a larger data.val_fraction, or a smaller seq_len"
        )
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(seq_len)
    return tokens[index].long(), tokens[index + 1].long()


def eval_batches(
    val: torch.Tensor, n_batches: int, batch_size: int, seq_len: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of `n_batches` held-out (x, y) batches, drawn from a private generator seeded with `seed`.

    The same arguments give the same batches in every run and every arm of a
    sweep, and the global torch RNG is left untouched.
    """
    generator = torch.Generator().manual_seed(seed)
    return [sample_batch(val, batch_size, seq_len, generator) for _ in range(n_batches)]


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """The standard library's `.py` files as sorted POSIX paths relative to `root`.

    `root` defaults to this interpreter's stdlib directory. Nothing under a
    `site-packages` or `dist-packages` directory is listed.
    """
    base = Path(root) if root is not None else _stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Pruning in place stops os.walk from descending into installed packages at all.
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(base)
        found.extend((rel_dir / name).as_posix() for name in filenames if name.endswith(".py"))
    return sorted(found)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _resolve_source(cfg: DataConfig) -> _Source:
    if cfg.source == "stdlib":
        return _stdlib_source()
    if cfg.source == "text":
        return _text_source(list(cfg.files))
    if cfg.source == "hf":
        return _hf_source(cfg)
    raise ConfigError(f"data.source={cfg.source!r} is not allowed: choose one of stdlib, text, hf")


def _stdlib_source() -> _Source:
    root = _stdlib_root()
    names = stdlib_files(root)
    if not names:
        raise DataError(f"no .py files found under the standard library directory {root}")
    manifest = []
    for name in names:
        try:
            st = (root / name).stat()
        except OSError as err:
            raise DataError(f"cannot read standard library file {root / name}: {err.strerror or err}") from None
        manifest.append([name, st.st_size, st.st_mtime_ns])
    return _Source(
        kind="stdlib",
        description=f"stdlib:{root}",
        spec={"source": "stdlib", "root": str(root), "files": manifest},
        documents=lambda: _read_files([root / name for name in names]),
    )


def _text_source(files: list) -> _Source:
    if not files:
        raise DataError("data.files is empty: data=text needs data.files=[path, ...]")
    paths = [Path(os.path.expanduser(str(f))) for f in files]
    manifest = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise DataError(f"data.files: {path} does not exist") from None
        except OSError as err:
            raise DataError(f"data.files: cannot read {path}: {err.strerror}") from None
        if not path.is_file():
            raise DataError(f"data.files: {path} is not a regular file")
        manifest.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return _Source(
        kind="text",
        description="text:" + ",".join(str(f) for f in files),
        spec={"source": "text", "files": manifest},
        # Read as bytes rather than through datasets' "text" builder: the tokens are the bytes, so
        # decoding and re-encoding could only alter them (newline translation, invalid UTF-8), and
        # the builder would also store a second, Arrow copy of every file in the Hugging Face cache.
        documents=lambda: _read_files(paths),
    )


def _read_files(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        try:
            yield path.read_bytes()
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror or err}") from None


def _hf_source(cfg: DataConfig) -> _Source:
    if not cfg.name:
        raise DataError("data.name is not set: data=hf needs data.name=<hub dataset name>")
    dataset = _load_hf_dataset(cfg.name, cfg.config_name, cfg.split)
    if cfg.text_field not in dataset.column_names:
        raise DataError(
            f"dataset {cfg.name!r} has no column {cfg.text_field!r}: "
            f"set data.text_field to one of {', '.join(dataset.column_names)}"
        )
    feature = dataset.features[cfg.text_field]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"column {cfg.text_field!r} of dataset {cfg.name!r} holds {feature}, not text")
    config_part = f":{cfg.config_name}" if cfg.config_name else ""
    return _Source(
        kind="hf",
        description=f"hf:{cfg.name}{config_part}/{cfg.split}",
        spec={
            "source": "hf",
            "name": cfg.name,
            "config_name": cfg.config_name,
            "split": cfg.split,
            "text_field": cfg.text_field,
            "fingerprint": getattr(dataset, "_fingerprint", None),
        },
        documents=lambda: _hf_documents(dataset, cfg.text_field),
    )


def _hf_documents(dataset, text_field: str) -> Iterator[bytes]:
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if text is not None:
                yield text.encode("utf-8")


def _load_hf_dataset(name: str, config_name: str | None, split: str):
    """Load one split of a hub (or local) dataset, failing fast with a DataError when the hub is out of reach.

    With HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, only the local Hugging Face
    cache is consulted. Otherwise, for a name that is not a local path, the hub
    host is probed first (about a second at most); if it does not answer, the
    load is retried from the local cache only, instead of letting datasets spend
    ~20 s on retries.
    """
    if _offline_requested():
        with _hf_offline():
            reason = "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
            return _call_load_dataset(name, config_name, split, reason)
    if not os.path.exists(name) and not _hub_reachable():
        host = urllib.parse.urlsplit(_hub_endpoint()).hostname
        with _hf_offline():
            return _call_load_dataset(name, config_name, split, f"cannot reach the Hugging Face hub ({host})")
    return _call_load_dataset(name, config_name, split, offline_reason=None)


def _call_load_dataset(name: str, config_name: str | None, split: str, offline_reason: str | None):
    import datasets

    try:
        return datasets.load_dataset(name, config_name, split=split)
    except Exception as err:
        # Offline, a dataset missing from the cache surfaces as a ConnectionError (hub names)
        # or a FileNotFoundError (cache lookups); anything else is a real problem with the request.
        if offline_reason and isinstance(err, (ConnectionError, FileNotFoundError)):
            raise DataError(
                f"{offline_reason} and dataset {name!r} is not in the local cache; "
                "run once with network access to download it, or use data=stdlib or data=text"
            ) from None
        raise DataError(f"cannot load Hugging Face dataset {name!r} (split {split!r}): {_one_line(err)}") from None


def _offline_requested() -> bool:
    import datasets.config
    import huggingface_hub.constants

    flags = (os.environ.get(var, "").upper() in _TRUE_VALUES for var in _OFFLINE_VARS)
    return any(flags) or bool(datasets.config.HF_HUB_OFFLINE) or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def _hf_offline():
    """Put datasets and huggingface_hub in offline mode for the duration of the block, then restore.

    Both libraries read the offline variables once, at import, so the module
    flags are set as well as the environment (the variables alone would not
    reach an already imported library). Not thread-safe: it edits process state.
    """
    import datasets.config
    import huggingface_hub.constants

    saved_env = {var: os.environ.get(var) for var in _OFFLINE_VARS}
    saved_flags = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    os.environ.update({var: "1" for var in _OFFLINE_VARS})
    datasets.config.HF_HUB_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved_flags
        for var, value in saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_HUB_ENDPOINT


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """True if a TCP connection to the hub host (or to the HTTPS proxy in front of it) opens within `timeout` s."""
    url = urllib.parse.urlsplit(_hub_endpoint())
    reachable: list[bool] = []

    def attempt() -> None:
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        proxy = urllib.request.getproxies().get(url.scheme)
        if proxy and not urllib.request.proxy_bypass(host or ""):
            proxy_url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            host, port = proxy_url.hostname, proxy_url.port or (443 if proxy_url.scheme == "https" else 80)
        try:
            with socket.create_connection((host, port), timeout=timeout):
                reachable.append(True)
        except (OSError, TypeError, ValueError):
            reachable.append(False)

    # Name resolution ignores socket timeouts and can stall for many seconds without DNS,
    # so the probe runs in a daemon thread and an unfinished probe counts as unreachable.
    probe = threading.Thread(target=attempt, name="normlab-hub-probe", daemon=True)
    probe.start()
    probe.join(timeout + 0.5)
    return bool(reachable) and reachable[0]


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _cache_root(cfg: DataConfig) -> Path:
    configured = cfg.cache_dir or os.environ.get("NORMLAB_CACHE") or "~/.cache/normlab"
    root = Path(os.path.expanduser(str(configured)))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the token cache directory {root}: {err.strerror or err}; "
            "set data.cache_dir or NORMLAB_CACHE"
        ) from None
    return root


def _cache_key(source: _Source) -> str:
    identity = {"tokenizer": TOKENIZER, "separator": SEPARATOR.hex(), "spec": source.spec}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _cached_tokens(root: Path, source: _Source) -> tuple[np.ndarray, dict]:
    """The source's tokens as a uint8 array plus the entry's metadata, building the cache entry on a miss."""
    key = _cache_key(source)
    bin_path = root / f"{source.kind}-{key}.bin"
    meta_path = root / f"{source.kind}-{key}.json"
    hit = _read_entry(bin_path, meta_path, key)
    if hit is not None:
        return hit
    try:
        with _exclusive(root / f"{source.kind}-{key}.lock"):
            # Another job may have finished building this entry while we waited for the lock.
            hit = _read_entry(bin_path, meta_path, key)
            if hit is not None:
                return hit
            n_bytes, sha256 = _write_tokens(source.documents(), bin_path)
            if n_bytes == 0:
                bin_path.unlink()
                raise DataError(f"{source.description} is empty: there is nothing to train on")
            meta = {
                "key": key,
                "tokenizer": TOKENIZER,
                "source": source.description,
                "n_bytes": n_bytes,
                "sha256": sha256,
                "spec": source.spec,
            }
            # The metadata goes in last: its presence is what marks the entry complete.
            _atomic_write(meta_path, lambda fh: fh.write(json.dumps(meta, indent=1).encode()))
            return _map_tokens(bin_path, n_bytes), meta
    except OSError as err:
        # Source read failures are already DataErrors, so an OSError here is about the cache itself.
        raise DataError(
            f"cannot write the token cache in {root}: {err.strerror or err}; set data.cache_dir or NORMLAB_CACHE"
        ) from None


def _read_entry(bin_path: Path, meta_path: Path, key: str) -> tuple[np.ndarray, dict] | None:
    """A complete, verified cache entry, or None if it is missing, stale or damaged."""
    try:
        meta = json.loads(meta_path.read_bytes())
        n_bytes = int(meta["n_bytes"])
        if meta["key"] != key or meta["tokenizer"] != TOKENIZER or n_bytes <= 0:
            return None
        if bin_path.stat().st_size != n_bytes:
            raise ValueError(f"{bin_path} holds {bin_path.stat().st_size} bytes, metadata says {n_bytes}")
        tokens = _map_tokens(bin_path, n_bytes)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("rebuilding damaged token cache entry %s: %s", meta_path, err)
        return None
    # Hashing the mapped file costs tens of ms for the stdlib corpus and guarantees that the
    # reported sha256 describes the tokens actually trained on.
    if hashlib.sha256(tokens).hexdigest() != meta.get("sha256"):
        log.warning("rebuilding token cache entry %s: content does not match its sha256", bin_path)
        return None
    return tokens, meta


def _map_tokens(path: Path, n_bytes: int) -> np.ndarray:
    # Copy-on-write mapping: jobs share the page cache, and the array is writable, which
    # torch.from_numpy requires; writes never reach the file.
    return np.asarray(np.memmap(path, dtype=np.uint8, mode="c", shape=(n_bytes,)))


def _write_tokens(documents: Iterable[bytes], dest: Path) -> tuple[int, str]:
    """Stream the documents, separator-joined, into `dest` atomically; return (token count, hex sha256)."""
    digest = hashlib.sha256()
    count = 0

    def write(fh) -> None:
        nonlocal count
        for i, doc in enumerate(documents):
            pieces = (doc,) if i == 0 else (SEPARATOR, doc)
            for piece in pieces:
                fh.write(piece)
                digest.update(piece)
                count += len(piece)

    _atomic_write(dest, write)
    return count, digest.hexdigest()


def _atomic_write(dest: Path, write: Callable) -> None:
    """Run `write` on a temporary file next to `dest`, then move it over `dest` in one step."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on `lock_path` (no-op where fcntl is unavailable)."""
    if fcntl is None:
        yield
        return
    with open(lock_path, "ab") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        yield
