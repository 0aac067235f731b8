"""Decode-node options of `oasiskv serve`, validated before anything starts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from pydantic import ValidationError

from oasiskv.cluster.serve_command import add_arguments_serve, config_from_args


def _config(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments_serve(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_max_replace_fraction_reaches_the_decode_config():
    assert _config().decode.max_replace_fraction == 0.05
    assert _config("--max-replace-fraction", "0.01").decode.max_replace_fraction == 0.01


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_out_of_range_max_replace_fraction_is_refused(value):
    with pytest.raises(ValidationError, match="max_replace_fraction"):
        _config("--max-replace-fraction", value)


def test_the_command_line_exits_2_on_a_bad_fraction_without_starting_ray():
    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--max-replace-fraction", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "max_replace_fraction" in done.stderr
