"""`oasiskv serve --device`: where prefill and decode workers run, and the GPUs they ask Ray for.

Ray empties CUDA_VISIBLE_DEVICES for an actor that asks for no GPU, so `device='cuda'` must
reach both the workers (model and KV pool on the GPU) and their Ray options (num_gpus). A GPU
asked for and not there is refused with a message, at the head when it started the cluster and
in the worker otherwise, never left to hang or to fail inside torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import NotEnoughGPUs, _options, check_gpus
from oasiskv.cluster.serve_command import add_arguments_serve, config_from_args
from oasiskv.decode_node.config import DecodeConfig
from oasiskv.models.device import parse_device, require_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def _config(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_arguments_serve(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_cpu_by_default_and_cuda_reaches_the_decode_config(monkeypatch):
    monkeypatch.delenv("OASISKV_DEVICE", raising=False)
    config = _config()
    assert (config.device, config.decode.device, config.gpus_needed) == ("cpu", "cpu", 0)
    config = _config("--device", "cuda", "--prefill-workers", "2", "--decode-workers", "3")
    assert (config.device, config.decode.device) == ("cuda", "cuda")
    assert config.gpus_needed == 5
    assert _config("--device", "cuda", "--gpus-per-worker", "0.5").gpus_needed == 1


def test_the_environment_sets_the_default_device(monkeypatch):
    """How the compose GPU override reaches the head's `oasiskv serve` without its own command line."""
    monkeypatch.setenv("OASISKV_DEVICE", "cuda")
    assert _config().decode.device == "cuda"
    assert _config("--device", "cpu").decode.device == "cpu"


@pytest.mark.parametrize("value", ["cuda:0", "cpu:0", "gpu"])
def test_a_device_from_the_environment_is_checked_as_a_given_one_is(monkeypatch, value):
    """$OASISKV_DEVICE=cuda:0 passed: serve asked Ray for no GPU (so Ray hid them) and failed in a
    worker; on a machine without one it started Ray first."""
    monkeypatch.setenv("OASISKV_DEVICE", value)
    with pytest.raises(ValidationError, match="'cpu' or 'cuda'"):
        ServeConfig()
    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "serve"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OASISKV_DEVICE": value})
    assert done.returncode == 2 and f"--device (from $OASISKV_DEVICE): Input should be 'cpu' or 'cuda' (got {value!r})" \
        in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("share", ["0", "1.5", "-1"])
def test_out_of_range_gpu_share_is_refused(share):
    with pytest.raises(ValidationError, match="gpus_per_worker"):
        _config("--device", "cuda", "--gpus-per-worker", share)


def test_a_decode_device_that_disagrees_is_refused_and_other_decode_settings_survive():
    with pytest.raises(ValidationError, match="disagrees with device"):
        ServeConfig(device="cpu", decode={"device": "cuda"})
    config = ServeConfig(device="cuda", decode={"device": "cuda:0", "mode": "dense", "budget_tokens": 512})
    assert (config.decode.device, config.decode.mode, config.decode.budget_tokens) == ("cuda:0", "dense", 512)
    config = ServeConfig(device="cuda", decode={"mode": "sparse-current", "max_replace_fraction": 0.01})
    assert (config.decode.device, config.decode.mode, config.decode.max_replace_fraction) == ("cuda", "sparse-current", 0.01)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "", "gpu"])
def test_device_names_are_checked_where_they_are_given(name):
    with pytest.raises(ValueError, match="device"):
        parse_device(name)
    with pytest.raises(ValidationError, match="device"):
        DecodeConfig(device=name)


def test_only_prefill_and_decode_workers_ask_ray_for_gpus():
    cuda = ServeConfig(device="cuda", gpus_per_worker=0.5, placement="resources")
    assert _options(cuda, "prefill")["num_gpus"] == _options(cuda, "decode")["num_gpus"] == 0.5
    assert "num_gpus" not in _options(cuda, "store")  # the store's arena is host memory
    assert _options(cuda, "decode")["resources"] == {"oasiskv_decode": 1}
    cpu = ServeConfig(device="cpu")
    assert not any("num_gpus" in _options(cpu, role) for role in ("prefill", "decode", "store"))


def test_too_few_gpus_are_refused_at_once_on_a_cluster_this_process_starts():
    config = ServeConfig(device="cuda", prefill_workers=1, decode_workers=2)
    check_gpus(config, 3.0)
    check_gpus(ServeConfig(device="cpu"), 0.0)
    with pytest.raises(NotEnoughGPUs, match=r"needs 3 GPU\(s\).*has 2"):
        check_gpus(config, 2.0)


def test_a_joined_cluster_short_of_gpus_is_warned_about_not_refused(caplog):
    """Its GPU nodes may still be joining (pods start in any order); the actors wait for them."""
    config = ServeConfig(device="cuda", address="auto")
    with caplog.at_level(logging.WARNING, logger="oasiskv.cluster"):
        check_gpus(config, 0.0)
    assert "waiting for GPU nodes" in caplog.text


@no_cuda
def test_serve_with_cuda_on_a_machine_without_gpus_exits_2_with_the_counts():
    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--device", "cuda", "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs 2 GPU(s)" in done.stderr and "has 0" in done.stderr, done.stderr[-2000:]


@no_cuda
def test_workers_refuse_cuda_before_loading_anything():
    from oasiskv.decode_node.worker import DecodeWorker
    from oasiskv.prefill_node.worker import PrefillWorker

    with pytest.raises(ValueError, match="CUDA is not available"):
        require_device("cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        PrefillWorker("no-such-model", device="cuda")  # refused before the model is looked up
    with pytest.raises(ValueError, match="CUDA is not available"):
        DecodeWorker("no-such-model", {"device": "cuda"})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_prefill_worker_stores_what_a_cpu_one_does():
    """The same prompt prefilled on the GPU and on the CPU: the same first token, and KV in the
    store that agrees to fp32 rounding (the GPU's matmuls sum in another order)."""
    from oasiskv.kvstore import KVStoreServer, connect
    from oasiskv.prefill_node.worker import PrefillWorker

    server = KVStoreServer(capacity_bytes=64 << 20, prefault=False)
    address = server.start()
    try:
        prompt = list(range(100, 400))
        results = {}
        for device in ("cpu", "cuda"):
            worker = PrefillWorker(os.environ.get("OASISKV_CUDA_TEST_MODEL", "smollm2-135m"), transport="tcp", device=device)
            assert next(worker.model.parameters()).device.type == device
            results[device] = worker.prefill(device, prompt, {"max_tokens": 4}, address, 8, 1, 4)
        assert results["cuda"].first_token == results["cpu"].first_token
        assert results["cuda"].initial_selection.shape == results["cpu"].initial_selection.shape
        layout = results["cpu"].layout
        blocks = layout.num_blocks(len(prompt))
        local = connect(server.store)
        stored = {}
        for device in ("cpu", "cuda"):
            units = torch.empty((layout.num_layers, blocks, layout.num_kv_heads, *layout.unit_shape), dtype=layout.dtype)
            layers, block_ids, heads = (a.reshape(-1) for a in np.indices(units.shape[:3]))
            local.read_blocks(device, layers, heads, block_ids, units).wait()
            stored[device] = units
        torch.testing.assert_close(stored["cuda"], stored["cpu"], rtol=1e-3, atol=1e-3)
    finally:
        server.stop()


def test_the_dtype_follows_the_device_unless_given(monkeypatch):
    """A GPU deployment (the Helm chart's GPU values give --device cuda and no --dtype) served
    in float32; `auto` is bf16 on CUDA and fp32 on CPUs, as `oasiskv generate`."""
    monkeypatch.delenv("OASISKV_DEVICE", raising=False)
    assert _config().dtype == "float32"
    assert _config("--device", "cuda").dtype == "bfloat16"
    assert _config("--device", "cuda", "--dtype", "float32").dtype == "float32"
    assert _config("--dtype", "bfloat16").dtype == "bfloat16"
    monkeypatch.setenv("OASISKV_DEVICE", "cuda")
    assert _config().dtype == "bfloat16"
    assert ServeConfig(device="cpu").dtype == "float32"
