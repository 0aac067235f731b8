"""bench/decode_throughput.py: the first working set its prompts carry, the pool it sizes, the
arguments it refuses and how it sums up repeated runs."""

import dataclasses
from itertools import combinations
from types import SimpleNamespace

import pytest
import torch

import bench.decode_throughput as decode_throughput
from bench.lookahead_accuracy import BLOCK, DenseContext
from oasiskv.kvstore import KVStore, connect
from oasiskv.models.attention import first_visible_block
from oasiskv.models.sampling import SamplingParams
from oasiskv.prefill_node.prefill import Prefiller, kv_layout_for
from tests.conftest import stdlib_source


# -- the first working set ------------------------------------------------------------------------
def made_up_prompt_set(num_tokens: int, sliding_windows: tuple, hot_blocks: range) -> decode_throughput.PromptSet:
    """A PromptSet over made-up keys (one KV head, one query head): the last row's query points
    along channel 0, where only `hot_blocks` have keys, so those rank first wherever they may."""
    head_dim = 4
    summaries = torch.zeros(1, num_tokens // BLOCK, 2, head_dim)
    summaries[0, hot_blocks, :, 0] = 5.0
    query = torch.zeros(len(sliding_windows), 1, head_dim)
    query[:, :, 0] = 1.0
    config = SimpleNamespace(num_layers=len(sliding_windows), sliding_window=sliding_windows, softmax_scale=0.5)
    ctx = SimpleNamespace(model=SimpleNamespace(config=config), ids=list(range(num_tokens)),
                          queries={num_tokens - 1: query}, summaries=lambda layer, end, dtype, kind: summaries,
                          packed_kv=lambda num_blocks: None)
    return decode_throughput.PromptSet(ctx, SimpleNamespace(summary_kind="minmax"), 1, 4)


def test_a_sliding_layer_selects_only_blocks_it_can_see_while_there_are_enough():
    """The best blocks by their keys lie before what a 256-token window at 1,024 tokens sees
    (block 48 on); a full-attention layer still takes them, the sliding one must not: the
    decode node's admission drops them, and the layer started with next to no working set."""
    prompts = made_up_prompt_set(1024, (None, 256), hot_blocks=range(2, 10))
    first_visible = first_visible_block(1024, 256, BLOCK)
    candidates_end = 1024 // BLOCK - 4

    full, sliding = prompts.selection(1024, budget_blocks=8)[:, 0].tolist()
    assert sorted(full) == list(range(2, 10))
    assert len(sliding) == 8 and min(sliding) >= first_visible

    # More budget than visible blocks: the prefill still hands over min(budget, candidates),
    # every visible block first and the hidden ones after them.
    full, sliding = prompts.selection(1024, budget_blocks=16)[:, 0].tolist()
    visible = candidates_end - first_visible
    assert len(sliding) == 16
    assert sorted(sliding[:visible]) == list(range(first_visible, candidates_end))
    assert all(block < first_visible for block in sliding[visible:])


def test_prompt_set_selection_is_the_prefillers_on_a_model_with_sliding_layers(smollm2_llm):
    """SmolLM2 with every other layer a 256-token sliding window (Gemma 3's local layers): the
    same blocks as the real prefill of the same 512-token prompt, in every layer and head."""
    model = smollm2_llm.model
    original = model.config
    windows = tuple(256 if layer % 2 else None for layer in range(original.num_layers))
    model.config = dataclasses.replace(original, sliding_window=windows)
    client = connect(KVStore(64 * 2**20), transport="inproc")
    try:
        ids = smollm2_llm.encode(stdlib_source())[:512]
        layout = kv_layout_for(model, BLOCK)
        prompts = decode_throughput.PromptSet(DenseContext(model, ids, {len(ids) - 1}), layout, 1, 4)
        ours = prompts.selection(len(ids), budget_blocks=8)
        prefilled = Prefiller(model, client, summary_kind=layout.summary_kind).prefill(
            "reference", ids, SamplingParams(max_tokens=2), budget_blocks=8, excluded_head_blocks=1,
            excluded_tail_blocks=4)
        client.free("reference")
    finally:
        model.config = original
        client.close()
    reference = prefilled.initial_selection
    assert ours.shape == reference.shape
    assert [[sorted(head) for head in layer] for layer in ours.tolist()] == \
        [[sorted(head) for head in layer] for layer in reference.tolist()]
    first_visible = first_visible_block(len(ids), 256, BLOCK)
    assert all(int(ours[layer].min()) >= first_visible for layer in range(len(windows)) if windows[layer])


# -- the pool -------------------------------------------------------------------------------------
def test_the_pool_never_lets_dense_run_more_than_dense_fit_requests():
    """6 prompts of 1024..384 tokens (--prompt-step 128): a pool of 4 x the longest ran 5 at once."""
    rows = [decode_throughput.dense_rows(1024 - 128 * i, 8, 3) for i in range(6)]
    for dense_fit in (2, 3, 4, 5):
        pool = decode_throughput.dense_fit_pool_rows(rows, dense_fit)
        assert pool >= max(rows)
        assert all(sum(group) > pool for group in combinations(rows, dense_fit + 1)), dense_fit
        assert pool <= dense_fit * max(rows)
    # Prompts of one length (the default step at 8K / 16K): dense_fit x the longest, as before.
    assert decode_throughput.dense_fit_pool_rows([66] * 8, 4) == 4 * 66
    # As many requests as dense_fit, or fewer: nothing more can fit.
    assert decode_throughput.dense_fit_pool_rows(rows[:3], 4) == 4 * max(rows)
    # dense_fit 1 with two small prompts: the pool still holds the longest request.
    assert decode_throughput.dense_fit_pool_rows([66, 26, 34], 1) == 66


# -- arguments ------------------------------------------------------------------------------------
class ModelLoadReached(Exception):
    pass


def stop_at_model_load(*args, **kwargs):
    raise ModelLoadReached


VALID = ["--quick", "--contexts", "1024", "--requests", "3", "--new-tokens", "8"]


@pytest.mark.parametrize("option, bad, good", [
    ("--requests", ["0"], ["1"]),
    ("--requests", ["12"], ["11"]),  # 1024 - 64 x 11 is below the 384 tokens a prompt needs
    ("--repeats", ["0"], ["2"]),
    ("--dense-fit", ["0"], ["1"]),
    ("--new-tokens", ["1", "--modes", "dense"], ["2", "--modes", "dense"]),  # 1: the prefill's token alone
    ("--new-tokens", ["0"], None),  # was the default, silently
    ("--budget-tokens", ["8"], ["16"]),
    ("--budget-tokens", ["24"], ["32"]),
    ("--budget-tokens", ["0"], None),
    ("--contexts", ["1024,many"], ["1024,2048"]),
    ("--contexts", ["0"], None),
    ("--num-draft-tokens", ["16"], ["15"]),
    ("--modes", ["dense,dense"], ["dense,lookahead"]),
    ("--modes", ["dense,lookahead+rate2"], ["dense,lookahead+rate1"]),
])
def test_a_bad_argument_is_refused_by_name_before_the_model_loads(option, bad, good, monkeypatch, capsys):
    monkeypatch.setattr(decode_throughput, "load_llm", stop_at_model_load)
    with pytest.raises(SystemExit) as refused:
        decode_throughput.main([*VALID, option, *bad])
    assert refused.value.code == 2
    message = capsys.readouterr().err
    assert option in message
    if good is not None:  # the nearest good value gets as far as loading the model
        with pytest.raises(ModelLoadReached):
            decode_throughput.main([*VALID, option, *good])


# -- repeats --------------------------------------------------------------------------------------
def made_up_run(tokens_per_s: float, run: int) -> dict:
    return {"tokens_per_s": tokens_per_s, "generated_tokens": 60, "wall_s": 60 / tokens_per_s,
            "kv_bytes_per_request": 1000 + run, "peak_kv_bytes": 2000 + run, "steps": 10 + run,
            "breakdown_s": {"admission": run}, "outputs": {"0": [run, 1, 2]}}


@pytest.mark.parametrize("speeds, median, middle_run", [
    ((10.0, 40.0, 20.0, 30.0), 25.0, 3),  # even: the mean of 20 and 30; the fields from the 30 run
    ((10.0, 40.0, 20.0), 20.0, 2),
])
def test_every_field_but_the_median_tokens_per_s_comes_from_one_named_run(speeds, median, middle_run):
    runs = [made_up_run(speed, i) for i, speed in enumerate(speeds)]
    summary = decode_throughput.summarize_context(1024, [1024], 0.1, {"dense": runs})["modes"]["dense"]
    assert summary["tokens_per_s"] == median
    assert summary["fields_from_run"] == middle_run
    assert "fields_from_run" in summary["fields_from_run_note"]
    run = runs[middle_run]
    assert {key: summary[key] for key in run if key != "tokens_per_s"} == {key: run[key] for key in run if key != "tokens_per_s"}
    assert summary["tokens_per_s_all"][middle_run] == run["generated_tokens"] / summary["wall_s"]
