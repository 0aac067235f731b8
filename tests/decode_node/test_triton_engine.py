"""The decode engine with `attention_kernel="triton"` against the torch path, on a real model.

On CPUs the kernel runs under Triton's interpreter, which must be switched on before the process
first imports triton; so the engine runs in a child process. The same engine, prompt and store
decode greedily twice, once per kernel: the tokens must be equal. The `cuda` test compiles the
kernel and does the same on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasiskv.decode_node.config import DecodeConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# Lookahead with a budget far below the prompt, so selection, prefetch and the window ring are all
# on the path the kernel reads; 8 tokens keep the interpreter's run short.
CHILD = r"""
import json, sys, torch
from oasiskv.decode_node.config import DecodeConfig
from oasiskv.decode_node.engine import DecodeEngine
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.engine import LLM
from oasiskv.models.pull import resolve_model
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller
from tests.conftest import stdlib_source

device, model = sys.argv[1], sys.argv[2]
llm = LLM(str(resolve_model(model)), dtype="float32", kv_cache_gb=0.05, device=device)
prompt = llm.encode(stdlib_source("argparse.py"))[:600]
store = KVStore(128 * 2**20)
params = SamplingParams(max_tokens=8, ignore_eos=True)
tokens = {}
for kernel in ("torch", "triton"):
    config = DecodeConfig(mode="lookahead", budget_tokens=160, kv_pool_gb=0.05, attention_kernel=kernel, device=device)
    client = connect(store)
    engine = DecodeEngine(llm.model, llm.tokenizer, client, config)
    assert engine.backend.use_triton == (kernel == "triton")
    result = Prefiller(llm.model, client).prefill(kernel, prompt, params, budget_blocks=config.budget_blocks,
                                                  excluded_head_blocks=config.sink_blocks,
                                                  excluded_tail_blocks=config.window_blocks)
    engine.add(result, params)
    tokens[kernel] = engine.run_to_completion()[kernel].token_ids
    engine.close()
print(json.dumps(tokens))
"""


def _decode_both(device: str, interpret: bool, model: str = "smollm2-135m") -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    result = subprocess.run([sys.executable, "-c", CHILD, device, model], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Slow-marked for the default suite's time (34 s under the interpreter); .ci/run runs it.
@pytest.mark.slow
@needs_triton
def test_triton_kernel_decodes_the_same_tokens_as_the_torch_path():
    tokens = _decode_both("cpu", interpret=True)
    assert len(tokens["torch"]) == 8
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.cuda
@needs_triton
def test_triton_kernel_decodes_the_same_tokens_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # A GPU host that has only another registry model pulled names it here (scripts/device-check.sh).
    tokens = _decode_both("cuda", interpret=False, model=os.environ.get("OASISKV_CUDA_TEST_MODEL", "smollm2-135m"))
    assert tokens["triton"] == tokens["torch"]


def test_triton_kernel_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_kernel='triton'"):
        DecodeConfig(attention_kernel="triton", device="cpu")
    assert not DecodeConfig(device="cpu").uses_triton_attention  # 'auto' is the torch path
    assert not DecodeConfig(device="cuda").uses_triton_attention
