"""Fixtures shared by every suite: real models pulled once per machine into the user cache."""

from __future__ import annotations

import dataclasses
import signal
import sysconfig
from pathlib import Path

import pytest
import torch

DEFAULT_MODEL = "smollm2-135m"


def stdlib_source(name: str = "argparse.py") -> str:
    """Real text nobody here wrote: a Python standard-library source file."""
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()


def default_sigint() -> None:
    """A Popen preexec_fn for a child a test sends Ctrl-C: a shell that ran the tests in the
    background (`pytest &`) left SIGINT ignored, children inherit that, and a terminal's process
    has the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from oasiskv.models.pull import resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    """The default model in fp32 on the CPU, with a small KV cache (tests share it; each test
    must leave no request behind)."""
    from oasiskv.models.engine import LLM

    llm = LLM(str(smollm2_dir), dtype="float32", kv_cache_gb=0.25)
    yield llm
    assert not llm.has_unfinished


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def sliding_llm(smollm2_llm):
    """SmolLM2 with every layer a 128-token sliding window, as Gemma 3's local layers (Gemma
    itself is a slow suite's model): the same weights, masks on positions."""
    from oasiskv.models.engine import LLM

    model = smollm2_llm.model
    original = model.config
    model.config = dataclasses.replace(original, sliding_window=(128,) * original.num_layers)
    try:
        yield LLM.from_model(model, smollm2_llm.tokenizer, dtype="float32", kv_cache_gb=0.25)
    finally:
        model.config = original
