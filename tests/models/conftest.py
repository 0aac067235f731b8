"""Shared fixtures: one model cache per machine, and transformers' own reading of each GGUF.

Pulls go to $OASISKV_CACHE or ~/.cache/oasiskv, like the product's, so the (network-bound)
first pull happens once per machine rather than once per test run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from oasiskv.models.model_cache import cache_root
from oasiskv.models.pull import gguf_path, pull_model

SMOL = "smollm2-135m"


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return cache_root()


@pytest.fixture(scope="session")
def smol_gguf(model_cache) -> Path:
    return gguf_path(SMOL, model_cache, progress=False)


@pytest.fixture(scope="session")
def smol_dir(model_cache) -> Path:
    return pull_model(SMOL, model_cache, progress=False)


@pytest.fixture(scope="session")
def python_source() -> str:
    """Real code no one here wrote, on every machine: the standard library's argparse."""
    return Path(argparse.__file__).read_text()
