"""Hugging Face datasets as sources: hub and saved-to-disk datasets, offline detection, and the hub probe.

Source `hf` (`DataConfig.source`): `datasets.load_dataset(name, config_name, split=split)` (streamed
with `streaming=true`), or `load_from_disk` for a directory written by `save_to_disk`; column
`text_field`, one document per row.

Offline: with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set only the local Hugging Face cache is consulted;
otherwise the hub host is probed with a TCP handshake first (about a second at most), and an
unreachable hub means the local cache only, so a missing dataset or tokenizer fails fast.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

from normlab.config import DataConfig
from normlab.data.errors import DataError
from normlab.data.sources import Source
from normlab.util.errors import one_line


HUB_PROBE_TIMEOUT = 1.0  # seconds; a reachable hub answers a TCP handshake far faster
DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def hf_source(cfg: DataConfig, split: str) -> Source:
    if not cfg.name:
        raise DataError("data.name is not set: data=hf needs data.name=<hub dataset name>")
    dataset = _load_hf_dataset(cfg.name, cfg.config_name, split, streaming=cfg.streaming)
    features = dataset.features  # None for some streamed datasets: their rows are checked as they come
    if features is not None and cfg.text_field not in features:
        raise DataError(
            f"dataset {cfg.name!r} has no column {cfg.text_field!r}: "
            f"set data.text_field to one of {', '.join(features)}"
        )
    feature = features[cfg.text_field] if features is not None else None
    if feature is not None and getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"column {cfg.text_field!r} of dataset {cfg.name!r} holds {feature}, not text")
    config_part = f":{cfg.config_name}" if cfg.config_name else ""
    spec = {
        "source": "hf",
        "name": cfg.name,
        "config_name": cfg.config_name,
        "split": split,
        "text_field": cfg.text_field,
    }
    # A stream has no fingerprint: it is identified by name, split and the bytes taken (max_bytes).
    spec.update({"streaming": True} if cfg.streaming else {"fingerprint": getattr(dataset, "_fingerprint", None)})
    return Source(
        kind="hf",
        description=f"hf:{cfg.name}{config_part}/{split}",
        spec=spec,
        documents=lambda: _hf_documents(dataset, cfg.text_field),
    )


def _hf_documents(dataset, text_field: str) -> Iterator[bytes]:
    # datasets takes seconds to import and only data=hf needs it.
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        for row in dataset:
            if text_field not in row:
                raise DataError(f"the streamed dataset has no column {text_field!r}: set data.text_field to one of {', '.join(row)}")
            if row[text_field] is not None:
                yield str(row[text_field]).encode("utf-8")
        return
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if text is not None:
                yield text.encode("utf-8")


class MissingSplit(LookupError):
    """The dataset has no split of the requested name."""


def _load_hf_dataset(name: str, config_name: str | None, split: str, streaming: bool = False):
    """Load one split of a hub (or local) dataset, failing fast with a DataError when the hub is out of reach.

    A directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` is read with
    `load_from_disk`. With HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, only the local Hugging Face
    cache is consulted. Otherwise, for a name that is not a local path, the hub host is probed
    first (about a second at most); if it does not answer, the load is retried from the local cache
    only, instead of letting datasets spend ~20 s on retries. Raises MissingSplit for an unknown split.
    """
    if _saved_to_disk(name):
        return _load_saved_split(name, split, streaming)
    if _offline_requested():
        with _hf_offline():
            reason = "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
            return _call_load_dataset(name, config_name, split, streaming, reason)
    if not os.path.exists(name) and not _hub_reachable():
        host = urllib.parse.urlsplit(_hub_endpoint()).hostname
        with _hf_offline():
            return _call_load_dataset(name, config_name, split, streaming, f"cannot reach the Hugging Face hub ({host})")
    return _call_load_dataset(name, config_name, split, streaming, offline_reason=None)


def _saved_to_disk(name: str) -> bool:
    path = Path(os.path.expanduser(name))
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_saved_split(name: str, split: str, streaming: bool):
    """One split of a dataset saved with save_to_disk; a lone saved Dataset counts as the split "train"."""
    # datasets takes seconds to import and only data=hf needs it.
    import datasets

    try:
        saved = datasets.load_from_disk(os.path.expanduser(name))
    except Exception as err:
        raise DataError(f"cannot load the saved dataset {name!r}: {one_line(err)}") from None
    splits = list(saved) if isinstance(saved, datasets.DatasetDict) else ["train"]
    if split not in splits:
        raise MissingSplit(f"it has {', '.join(splits)}")
    dataset = saved[split] if isinstance(saved, datasets.DatasetDict) else saved
    return dataset.to_iterable_dataset() if streaming else dataset


def _call_load_dataset(name: str, config_name: str | None, split: str, streaming: bool, offline_reason: str | None):
    # datasets takes seconds to import and only data=hf needs it.
    import datasets

    try:
        return datasets.load_dataset(name, config_name, split=split, streaming=streaming)
    except Exception as err:
        # datasets says 'Unknown split "x". Should be one of [...]' (or 'Bad split: x. Available splits: [...]').
        if isinstance(err, ValueError) and ("Unknown split" in str(err) or "Bad split" in str(err)):
            raise MissingSplit(one_line(err)) from None
        # Offline, a dataset missing from the cache surfaces as a ConnectionError (hub names)
        # or a FileNotFoundError (cache lookups); anything else is a real problem with the request.
        if offline_reason and isinstance(err, (ConnectionError, FileNotFoundError)):
            raise DataError(
                f"{offline_reason} and dataset {name!r} is not in the local cache; "
                "run once with network access to download it, or use data=stdlib or data=text"
            ) from None
        raise DataError(f"cannot load Hugging Face dataset {name!r} (split {split!r}): {one_line(err)}") from None


def _offline_requested() -> bool:
    if any(os.environ.get(var, "").upper() in _TRUE_VALUES for var in _OFFLINE_VARS):
        return True
    # datasets takes seconds to import and only data=hf needs it.
    import datasets.config
    import huggingface_hub.constants

    return bool(datasets.config.HF_HUB_OFFLINE) or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def _hf_offline():
    """Put datasets and huggingface_hub in offline mode for the duration of the block, then restore.

    Both libraries read the offline variables once, at import, so the module
    flags are set as well as the environment (the variables alone would not
    reach an already imported library). Not thread-safe: it edits process state.
    """
    # datasets takes seconds to import and only data=hf needs it.
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


def tokenizer_offline_reason(name: str) -> str | None:
    """Why a hub tokenizer may only come from the local cache (offline flags, an unreachable hub), or None.

    Unlike `_offline_requested` it does not import datasets, so a cache miss fails within a second.
    """
    # Only tokenizer=hf needs huggingface_hub (an optional, slow import).
    import huggingface_hub.constants

    if os.path.exists(os.path.expanduser(name)):
        return None
    if any(os.environ.get(var, "").upper() in _TRUE_VALUES for var in _OFFLINE_VARS) or huggingface_hub.constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"
    if not _hub_reachable():
        return f"cannot reach the Hugging Face hub ({urllib.parse.urlsplit(_hub_endpoint()).hostname})"
    return None
