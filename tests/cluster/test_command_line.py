"""What the command line tells its user: every option's default in --help, and a bad value
named by the flag that was typed rather than by the config field behind it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
from pydantic import ValidationError

from oasiskv.cluster.cli import build_parser
from oasiskv.cluster.serve_command import add_arguments_serve, config_from_args
from oasiskv.config_errors import describe

COMMANDS = (["serve"], ["generate"], ["kvstore"], ["bench", "serve"], ["models", "pull"])


def _command_parser(words: list[str]) -> argparse.ArgumentParser:
    parser = build_parser(words[0])
    for word in words:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return parser


def _help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's entry in --help (its first flag -> the entry's text on one line)."""
    entries: dict[str, str] = {}
    flag = None
    for line in parser.format_help().splitlines():
        if re.match(r"^  -", line):
            flag = line.split()[0].rstrip(",")
            entries[flag] = ""
        elif not line.startswith("   "):
            flag = None
        if flag:
            entries[flag] = f"{entries[flag]} {line.strip()}"
    return entries


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_every_option_with_a_default_shows_it_in_help(words):
    parser = _command_parser(words)
    entries = _help_entries(parser)
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default is None or default is False or default in ([], argparse.SUPPRESS):
            continue
        entry = entries[action.option_strings[0]]
        assert "default" in entry, f"{' '.join(words)} {action.option_strings[0]}: no default in {entry!r}"


def test_serve_help_gives_the_values_serve_runs_with():
    entries = _help_entries(_command_parser(["serve"]))
    assert entries["--budget-tokens"].endswith("(default: 2048)")
    assert entries["--store-port"].endswith("first store's port (0: any free port) (default: 0)")
    assert entries["--mode"].endswith("(default: lookahead)")
    assert "(default 1; 0: off;" in entries["--prefix-cache-gb"]
    assert config_from_args(_serve_args()).prefix_cache_gb == 1.0
    assert "(default" not in entries["--api-key"]  # no default, so no '(default: None)'


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments_serve(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "expected"), [
    (("--budget-tokens", "7"), "--budget-tokens: Input should be greater than or equal to 16 (got 7)"),
    (("--budget-tokens", "100"), "--budget-tokens (100) must be a multiple of block_size (16)"),
    (("--store-ttl-s", "0"), "--store-ttl-s: Input should be greater than 0 (got 0.0)"),
    (("--prefix-cache-gb", "-1"), "--prefix-cache-gb: Input should be greater than or equal to 0 (got -1.0)"),
    (("--prefix-cache-gb", "2", "--prefill-engine", "vllm"),
     "--prefix-cache-gb is the oasiskv prefill engine's; vLLM prefill workers run without a prefix cache (leave it "
     "out, or give 0)"),
])
def test_a_bad_value_is_named_by_its_flag(argv, expected):
    args = _serve_args(*argv)
    with pytest.raises(ValidationError) as caught:
        config_from_args(args)
    assert describe(caught.value, args) == expected
    assert "decode." in describe(caught.value) or "_" in describe(caught.value)  # the config's own names without args


def test_generate_names_its_flag_for_a_bad_sampling_value():
    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "generate", "--prompt", "x", "--top-p", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == "error: --top-p must be in (0, 1], got 2.0"


def test_version_prints_the_package_s_version():
    from oasiskv import __version__

    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"oasiskv {__version__}")
