"""The run configuration: its schema, the norm and placement registries, validation and parsing.

`RunConfig.from_dict` turns Hydra's resolved mapping into typed dataclasses and checks every value
before anything heavy starts; a bad value raises `ConfigError` with one line. Nothing here imports
torch. The modules, one concept each:

- registry: one row per norm and per placement (NORM_TRAITS, PLACEMENT_TRAITS), and the sinks' names;
- schema: the dataclasses (NormConfig ... RunConfig), the `bookkeeping` mark and the schema's dotted keys;
- validate: the values each key may take and every check of `RunConfig.validate`;
- parse: building the dataclasses from a mapping, and the text forms of keys and values;
- reads: which keys a run reads, given its choices (mix_p only under placement=mix, ...);
- packing: which runs of a sweep train together as one packed model.
"""

from normlab.config.errors import ConfigError
from normlab.config.parse import flatten_config, format_lr, nest_config
from normlab.config.reads import READ_ONLY_UNDER, reads_key
from normlab.config.registry import (
    ALPHA_PARAMS,
    GAIN_PARAMS,
    NORM_TRAITS,
    NORMS,
    PLACEMENT_TRAITS,
    PLACEMENTS,
    SHIFT_PARAMS,
    SINK_NAMES,
    NormTraits,
    PlacementTraits,
    check_norm_knob,
    norm_traits,
)
from normlab.config.schema import (
    CkptConfig,
    DataConfig,
    ModelConfig,
    NormConfig,
    OptimConfig,
    RunConfig,
    TelemetryConfig,
    TokenizerConfig,
    WandbConfig,
    bookkeeping_keys,
    is_bookkeeping,
    run_identity,
    schema_keys,
    suggest_key,
    unknown_key_message,
)
from normlab.config.validate import BPE_VOCAB_RANGE, BYTE_VOCAB, KEY_CHOICES, TOKENIZERS

__all__ = [
    "ALPHA_PARAMS",
    "BPE_VOCAB_RANGE",
    "BYTE_VOCAB",
    "CkptConfig",
    "ConfigError",
    "DataConfig",
    "GAIN_PARAMS",
    "KEY_CHOICES",
    "ModelConfig",
    "NORMS",
    "NORM_TRAITS",
    "NormConfig",
    "NormTraits",
    "OptimConfig",
    "PLACEMENTS",
    "PLACEMENT_TRAITS",
    "READ_ONLY_UNDER",
    "PlacementTraits",
    "RunConfig",
    "SHIFT_PARAMS",
    "SINK_NAMES",
    "TOKENIZERS",
    "TelemetryConfig",
    "TokenizerConfig",
    "WandbConfig",
    "bookkeeping_keys",
    "check_norm_knob",
    "flatten_config",
    "format_lr",
    "is_bookkeeping",
    "nest_config",
    "norm_traits",
    "reads_key",
    "run_identity",
    "schema_keys",
    "suggest_key",
    "unknown_key_message",
]
