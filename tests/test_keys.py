"""The metric-key grammar (normlab.keys): building, parsing and the long-form layer table."""

import math

from normlab import keys


def test_layer_label_is_padded_to_the_depth():
    assert keys.layer_label(3, 4) == "L03"
    assert keys.layer_label(7, 120) == "L007"


def test_parse_round_trips_layer_keys():
    key = keys.layer_key("grad/norm", "L03", "mlp")
    assert key == "grad/norm/L03/mlp"
    assert keys.parse(key) == keys.LayerKey("grad/norm", 3, "mlp", "L03")
    assert keys.parse("act/resid_rms/L11") == keys.LayerKey("act/resid_rms", 11, None, "L11")
    assert keys.parse("norm/gain_mean/L00/norm1").part == "norm1"
    for other in ("loss", "grad/embed_norm", "update_ratio/norm_f", "act/Lx"):
        assert keys.parse(other) is None


def test_layer_values_take_whole_block_finite_values_only():
    row = {"grad/norm/L00": 1.5, "grad/norm/L01": None, "grad/norm/L00/mlp": 9.0, "grad/norm/L02": "inf", "loss": 2.0}
    assert keys.layer_values(row, "grad/norm") == {0: 1.5}


def test_layer_table_is_long_form_over_records_with_layer_keys():
    records = [
        {"step": 0, "loss": 3.0, "act/resid_rms/L00": 1.0, "act/resid_rms/L01": 2.0, "grad/norm/L01/mlp": 0.5},
        {"step": 5, "loss": 2.5},  # no telemetry: no rows
        {"step": 10, "act/resid_rms/L00": 1.1, "act/resid_rms/L01": 2.2},
    ]
    columns, rows = keys.layer_table(records)
    assert columns == ["step", "layer", "act/resid_rms", "grad/norm/mlp"]
    assert rows == [
        [0, "L00", 1.0, None],
        [0, "L01", 2.0, 0.5],
        [10, "L00", 1.1, None],
        [10, "L01", 2.2, None],
    ]


def test_to_float_reads_what_metrics_jsonl_writes():
    assert keys.to_float("inf") == math.inf
    assert math.isnan(keys.to_float(None))
    assert math.isnan(keys.to_float(True))
    assert keys.to_float(3) == 3.0
