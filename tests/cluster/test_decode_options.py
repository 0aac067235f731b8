"""Decode-node options of `oasiskv serve`, validated before anything starts."""

from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

import torch

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import _raised_in_worker
from oasiskv.cluster.serve_command import add_arguments_serve, config_from_args, unread_flags
from oasiskv.kvstore import DEFAULT_SUMMARY_KIND, KVStoreServer, connect, summarize_request
from oasiskv.prefill_node.worker import PrefillWorker


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
    assert "--max-replace-fraction: " in done.stderr  # the flag the user typed, not the config field


def test_a_worker_that_cannot_start_is_named_with_its_own_error():
    """The decode worker's constructor raises (a draft model whose vocabulary is not the
    target's; one that does not exist is refused before Ray starts, test_serve_start_checks.py):
    serve exits 2 with one line naming the worker and the cause, not Ray's traceback of the
    actor's death."""
    done = subprocess.run([sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--drafter", "qwen2.5-coder-0.5b",
                           "--port", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: decode-0 failed to start: " in done.stderr and "does not match the target's" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_exception_is_cut_from_the_traceback_ray_carries():
    text = ("The actor died because of an error raised in its creation task, ray::DecodeWorker.__init__() "
            "(pid=1, ip=x)\n  File \"/w/worker.py\", line 44, in __init__\n    drafter = build_drafter(...)\n"
            "              ^^^^^^^^^^^^^\n  File \"/w/speculative.py\", line 9, in build\n    raise DrafterMismatch(\n"
            "pkg.DrafterMismatch: vocabularies differ\nsecond line of the message")
    assert _raised_in_worker(text) == "pkg.DrafterMismatch: vocabularies differ\nsecond line of the message"
    assert _raised_in_worker("no frames at all\nRuntimeError: boom") == "RuntimeError: boom"


def test_lookahead_topup_reaches_the_decode_config():
    assert _config().decode.lookahead_topup_blocks == 0
    assert _config("--lookahead-topup-blocks", "4").decode.lookahead_topup_blocks == 4
    with pytest.raises(ValidationError, match="lookahead_topup_blocks"):
        _config("--lookahead-topup-blocks", "-1")


def test_prefetch_rank_fraction_reaches_the_decode_config():
    assert _config().decode.prefetch_rank_fraction == 0.25
    assert _config("--prefetch-rank-fraction", "1").decode.prefetch_rank_fraction == 1.0
    for value in ("0", "1.5"):
        with pytest.raises(ValidationError, match="prefetch_rank_fraction"):
            _config("--prefetch-rank-fraction", value)


def test_lookahead_layer_group_reaches_the_decode_config():
    assert _config().decode.lookahead_layer_group == 4
    assert _config("--lookahead-layer-group", "1").decode.lookahead_layer_group == 1
    with pytest.raises(ValidationError, match="lookahead_layer_group"):
        _config("--lookahead-layer-group", "0")


def test_miss_policy_reaches_the_decode_config():
    assert _config().decode.miss_policy == "wait"
    assert _config("--miss-policy", "skip").decode.miss_policy == "skip"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        _config("--miss-policy", "drop")


def test_draft_model_options_reach_the_decode_config():
    decode = _config().decode
    assert (decode.draft_window_tokens, decode.draft_catch_up_budget) == (1024, None)
    decode = _config("--draft-window-tokens", "512", "--draft-catch-up-budget", "0").decode
    assert (decode.draft_window_tokens, decode.draft_catch_up_budget) == (512, 0)
    with pytest.raises(ValidationError, match="draft_window_tokens"):
        _config("--draft-window-tokens", "0")
    with pytest.raises(ValidationError, match="draft_catch_up_budget"):
        _config("--draft-catch-up-budget", "-5")


def test_draft_model_options_given_with_ngram_drafts_are_named_as_unread():
    parser = argparse.ArgumentParser()
    add_arguments_serve(parser)

    def unread(*argv):
        args = parser.parse_args(list(argv))
        return unread_flags(args, config_from_args(args))

    assert unread("--draft-window-tokens", "512", "--draft-catch-up-budget", "0") == [
        "--draft-window-tokens is read only with a draft model: ignored with --drafter ngram",
        "--draft-catch-up-budget is read only with a draft model: ignored with --drafter ngram"]
    assert unread("--drafter", "qwen2.5-coder-0.5b", "--draft-window-tokens", "512") == []
    # read whatever --mode is: a request may ask for lookahead itself
    assert unread("--mode", "dense", "--lookahead-topup-blocks", "4", "--miss-policy", "skip") == []
    assert unread() == []


def test_summary_kind_reaches_the_cluster_config():
    assert _config().summary_kind == DEFAULT_SUMMARY_KIND == "moments"
    assert _config("--summary-kind", "minmax").summary_kind == "minmax"
    assert _config("--summary-kind", "moments").summary_kind == "moments"
    with pytest.raises(ValidationError, match="summary_kind"):
        ServeConfig(summary_kind="median")


def test_prefill_worker_names_its_summary_kind_in_the_layout():
    """The kind the cluster chose travels with every prefilled request (its store layout, over
    the wire to a store server), so the store and the decode node summarize the same way."""
    server = KVStoreServer(capacity_bytes=32 << 20, prefault=False)
    address = server.start()
    try:
        worker = PrefillWorker("smollm2-135m", transport="tcp", summary_kind="moments")
        prompt = list(range(100, 180))
        result = worker.prefill("kind", prompt, {"max_tokens": 1}, address, 2, 1, 1)
        assert result.layout.summary_kind == "moments"
        layout = result.layout
        blocks = layout.num_blocks(len(prompt))
        units = torch.empty((layout.num_layers, blocks, layout.num_kv_heads, *layout.unit_shape), dtype=layout.dtype)
        layers, block_ids, heads = (a.reshape(-1) for a in np.indices(units.shape[:3]))
        local = connect(server.store)
        local.read_blocks("kind", layers, heads, block_ids, units).wait()
        keys = units[:, :, :, 0].permute(0, 1, 3, 2, 4).reshape(layout.num_layers, -1, layout.num_kv_heads, layout.head_dim)
        torch.testing.assert_close(local.read_summaries("kind"), summarize_request(keys[:, : len(prompt)], 16, "moments"))
        worker.free("kind", address)
    finally:
        server.stop()


def test_workers_placed_by_role_resources_size_their_own_threads():
    """The head's cores say nothing of a worker pod's: with --placement resources the head sends
    no thread count unless one is given (the worker splits its own node's CPUs)."""
    assert _config("--placement", "resources").worker_threads() is None
    assert _config("--placement", "resources", "--threads-per-worker", "3").worker_threads() == 3
    assert _config("--prefill-workers", "1", "--decode-workers", "1").worker_threads() >= 1
