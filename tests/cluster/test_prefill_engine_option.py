"""`--prefill-engine`: validated before anything starts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from pydantic import ValidationError

from oasiskv.cluster.config import ServeConfig

NO_VLLM = importlib.util.find_spec("vllm") is None


def test_default_prefill_engine_is_oasiskv():
    assert ServeConfig().prefill_engine == "oasiskv"


def test_unknown_prefill_engine_is_rejected():
    with pytest.raises(ValidationError, match="oasiskv"):
        ServeConfig(prefill_engine="sglang")


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here; tests/vllm_interop covers the vllm engine")
def test_vllm_prefill_engine_without_vllm_says_how_to_install_it():
    with pytest.raises(ValidationError, match="scripts/install.sh --vllm"):
        ServeConfig(prefill_engine="vllm")
    # The command line says so too, and exits 2 without starting Ray.
    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--prefill-engine", "vllm"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs vLLM" in done.stderr
