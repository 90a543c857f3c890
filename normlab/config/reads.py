"""Which config keys a run reads, given its choices: a key that belongs to one choice (mix_p to
placement=mix, tokenizer.vocab_size to tokenizer=bpe, data.split to data=hf, a norm knob to the norms
that have it) changes nothing in a run that made another. `normlab compare` leaves such keys out of
the arms and of the common settings.
"""

from __future__ import annotations

from typing import Any, Mapping

from normlab.config.registry import NORM_TRAITS

# key: (the key that makes the choice, the values under which the key is read)
READ_ONLY_UNDER: dict[str, tuple[str, tuple[Any, ...]]] = {
    "mix_p": ("placement", ("mix",)),
    "residual_gate_init": ("residual_gate", ("rezero", "layerscale")),
    "qk_norm_axis": ("qk_norm", (True,)),
    "qk_norm_gains": ("qk_norm", (True,)),
    "tokenizer.vocab_size": ("tokenizer.kind", ("bpe",)),
    "tokenizer.name": ("tokenizer.kind", ("hf",)),
    "data.files": ("data.source", ("text",)),
    "data.text_field": ("data.source", ("text", "hf")),
    "data.name": ("data.source", ("hf",)),
    "data.config_name": ("data.source", ("hf",)),
    "data.split": ("data.source", ("hf",)),
    "data.streaming": ("data.source", ("hf",)),
    "data.val_split": ("data.source", ("hf",)),
    "data.holdout": ("data.source", ("stdlib", "text", "hf")),
    "data.not_utf8": ("data.source", ("stdlib", "text", "hf")),
    "data.val_docs": ("data.holdout", ("first",)),
    "data.train": ("data.source", ("tokens",)),
    "data.val": ("data.source", ("tokens",)),
    "data.dtype": ("data.source", ("tokens",)),
}


def reads_key(settings: Mapping[str, Any], key: str) -> bool:
    """Whether a run whose flat dotted config is `settings` reads config key `key`. A choice the settings do
    not record (an old run dir) counts as reading it, as does every key of an unknown norm."""
    if key.startswith("norm.") and key != "norm.name":
        norm, knob = settings.get("norm.name"), key.removeprefix("norm.")
        if norm not in NORM_TRAITS:
            return True
        traits = NORM_TRAITS[norm]
        # a norm without a module (norm=none) reads its knobs only for QK-norm's RMSNorm
        return knob in traits.knobs and (bool(traits.classes) or settings.get("qk_norm", True) is not False)
    if key not in READ_ONLY_UNDER:
        return True
    choice, values = READ_ONLY_UNDER[key]
    return choice not in settings or settings[choice] in values
