"""Mode labels of the benchmarks ('lookahead+depth0.5') and how they meet command-line overrides."""

from argparse import Namespace

import pytest

from bench.common import decode_overrides, parse_mode
from oasiskv.decode_node.config import DecodeConfig

MODES = ("dense", "sparse-current", "lookahead")
FIELDS = ("max_replace_fraction", "lookahead_topup_blocks")


def test_a_label_names_its_mode_and_its_decode_config_variants():
    assert parse_mode("dense", MODES) == ("dense", {})
    assert parse_mode("lookahead+topup4+rate0.01+depth0.5", MODES) == (
        "lookahead", {"lookahead_topup_blocks": 4, "max_replace_fraction": 0.01, "prefetch_rank_fraction": 0.5})
    assert parse_mode("lookahead+group1", MODES) == ("lookahead", {"lookahead_layer_group": 1})
    assert DecodeConfig(**parse_mode("lookahead+group8", MODES)[1]).lookahead_layer_group == 8
    assert parse_mode("lookahead+skip+rate0.01", MODES) == (
        "lookahead", {"miss_policy": "skip", "max_replace_fraction": 0.01})
    assert DecodeConfig(**parse_mode("lookahead+skip", MODES)[1]).miss_policy == "skip"
    assert DecodeConfig(**parse_mode("lookahead+uint8", MODES)[1]).summary_read_dtype == "uint8"
    assert DecodeConfig(**parse_mode("lookahead+bf16", MODES)[1]).summary_read_dtype == "bfloat16"


@pytest.mark.parametrize("label, problem", [
    ("quest", "unknown mode 'quest'"),
    ("lookahead+speed2", "unknown variant 'speed2'"),
    ("lookahead+topupfour", "topup takes a number"),
    ("lookahead+skip2", "unknown variant 'skip2'.*skip"),
])
def test_a_bad_label_is_refused_by_name(label, problem):
    with pytest.raises(ValueError, match=problem):
        parse_mode(label, MODES)


def test_a_variant_overrides_the_same_field_given_on_the_command_line():
    args = Namespace(max_replace_fraction=0.02, lookahead_topup_blocks=None)
    _, variant = parse_mode("lookahead+rate0.01", MODES)
    overrides = decode_overrides(args, FIELDS, variant)
    assert overrides == {"max_replace_fraction": 0.01}
    assert DecodeConfig(mode="lookahead", **overrides).max_replace_fraction == 0.01
    # Without a variant the command line's value stands; fields left at None are not passed.
    assert decode_overrides(args, FIELDS, {}) == {"max_replace_fraction": 0.02}
