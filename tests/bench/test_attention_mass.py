"""bench.attention_mass: per-head attention a selection held against the best top-K, on small
hand-made attention maps (the benchmark runs it on a real model)."""

import pytest
import torch

from bench.attention_mass import ResidentSets, block_mass, mass_by_head, selectable_blocks, summarize_mass
from oasiskv.decode_node.working_set import EMPTY

BS = 4


def test_block_mass_adds_each_groups_attention_per_block():
    # 1 KV head, 1 row, a group of 2 query heads over 10 keys (3 blocks, the last one partial).
    probs = torch.zeros(1, 1, 2, 10)
    probs[0, 0, 0, 1] = 1.0  # head 0: all on key 1 (block 0)
    probs[0, 0, 1, 5], probs[0, 0, 1, 9] = 0.5, 0.5  # head 1: blocks 1 and 2
    mass = block_mass(probs, BS)
    assert mass.shape == (1, 1, 3)
    assert torch.allclose(mass[0, 0], torch.tensor([0.5, 0.25, 0.25]))


def attention_map(row_masses: list[list[float]]) -> dict[int, torch.Tensor]:
    """One layer, one KV head: each row's attention per block."""
    return {0: torch.tensor(row_masses)[None]}


def held_blocks(rows: dict[int, list[int]]) -> ResidentSets:
    sets = ResidentSets()
    for position, blocks in rows.items():
        sets.blocks[(0, position)] = torch.tensor([blocks])
    return sets


def test_missed_is_what_the_best_top_k_holds_and_the_run_did_not():
    # 8 blocks; the row sits in block 7, so with 1 sink and a window of 2 the candidates are 1..5.
    position = 7 * BS + 1
    row = [0.10, 0.30, 0.05, 0.20, 0.01, 0.04, 0.10, 0.20]
    mass = attention_map([row])
    held = held_blocks({position: [0, 3, 4, 6, 7, EMPTY]})  # of the candidates: 3 (0.20) and 4 (0.01)
    out = mass_by_head(mass, torch.tensor([position]), held, BS, sinks=1, window=2, budget_blocks=2)
    assert out["rows"] == 1
    assert out["window"][0][0] == pytest.approx(0.10 + 0.10 + 0.20)
    assert out["ideal"][0][0] == pytest.approx(0.30 + 0.20)  # blocks 1 and 3
    assert out["resident"][0][0] == pytest.approx(0.20 + 0.01)
    summary = summarize_mass(out)
    assert summary["missed_mean"] == pytest.approx(0.29)
    assert summary["worst"][0] == {"layer": 0, "kv_head": 0, "missed": pytest.approx(0.29), "ideal": pytest.approx(0.5)}


def test_rows_the_run_never_verified_are_left_out():
    positions = torch.tensor([7 * BS, 7 * BS + 1])
    mass = attention_map([[0.0, 1.0, 0, 0, 0, 0, 0, 0], [0.0, 0, 1.0, 0, 0, 0, 0, 0]])
    held = held_blocks({7 * BS: [1]})  # the second row (the last token) was never verified
    out = mass_by_head(mass, positions, held, BS, sinks=1, window=2, budget_blocks=1)
    assert out["rows"] == 1
    assert out["resident"][0][0] == pytest.approx(1.0)
    assert summarize_mass(out)["missed_mean"] == pytest.approx(0.0)


def test_recording_sees_every_layer_the_engine_attends_and_stops_after(smollm2_llm):
    from oasiskv.decode_node.attention import SparseAttention
    from oasiskv.decode_node.config import DecodeConfig
    from oasiskv.decode_node.engine import DecodeEngine
    from oasiskv.kvstore import KVStore, connect
    from oasiskv.models.sampling import SamplingParams
    from oasiskv.prefill_node.prefill import Prefiller

    from ..conftest import stdlib_source

    prompt = smollm2_llm.encode(stdlib_source("argparse.py"))[:640]
    client = connect(KVStore(64 * 2**20), transport="inproc")
    config = DecodeConfig(mode="lookahead", budget_tokens=64, kv_pool_gb=0.05)
    engine = DecodeEngine(smollm2_llm.model, smollm2_llm.tokenizer, client, config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    result = Prefiller(smollm2_llm.model, client).prefill("recorded", prompt, params, budget_blocks=config.budget_blocks)
    original = SparseAttention._attend_resident
    sets = ResidentSets()
    with sets.recording():
        engine.add(result, params)
        engine.run_to_completion()
    engine.close()
    assert SparseAttention._attend_resident is original
    assert {layer for layer, _ in sets.blocks} == set(range(smollm2_llm.model.config.num_layers))
    position = len(prompt)  # the first token's row
    held = sets.blocks[(0, position)]
    assert held.shape[0] == smollm2_llm.model.config.num_kv_heads
    assert (held == position // config.block_size).any(dim=1).all()  # its own block, in the window
    budget = held[:, config.sink_blocks + config.window_blocks + 1:]
    assert ((budget != EMPTY).sum(dim=1) > 0).all()  # and a selection in the budget rows


def test_texts_pool_the_attention_per_head_before_ranking_the_worst():
    from bench.sparse_quality import pool_texts

    def text(ideal, resident):
        by_head = {"window": [[0.5, 0.5]], "ideal": [ideal], "resident": [resident]}
        row = {"mode": "lookahead", "budget_tokens": 2048, "summary_kind": "moments", "top1_agreement": 0.9,
               "perplexity": 2.0, "perplexity_ratio": 1.0, "attention_mass": {**summarize_mass(by_head), "by_head": by_head}}
        return {"runs": [row]}

    # Head 0 misses 0.3 in one text and nothing in the other; head 1 misses 0.2 in both.
    pooled = pool_texts([text([0.4, 0.3], [0.1, 0.1]), text([0.4, 0.3], [0.4, 0.1])],
                        ("mode", "budget_tokens", "summary_kind"))
    mass = pooled[0]["attention_mass"]
    assert mass["missed_mean"] == pytest.approx(0.175)
    assert [(p["kv_head"], round(p["missed"], 3)) for p in mass["worst"]] == [(1, 0.2), (0, 0.15)]


def test_a_sliding_window_row_selects_only_blocks_it_can_see():
    # Rows at 1,000 and 1,100 with a 512-token window see keys from 489 and 589 on: blocks 30 and 36 (of 16).
    positions = torch.tensor([1000, 1100])
    candidate, always = selectable_blocks(positions, 69, 16, sinks=1, window=4, sliding_window=512)
    assert candidate[0].nonzero().flatten().tolist() == list(range(30, 59))
    assert candidate[1].nonzero().flatten().tolist() == list(range(36, 65))
    full, always_full = selectable_blocks(positions, 69, 16, sinks=1, window=4)
    assert full[0].nonzero().flatten().tolist() == list(range(1, 59))
    assert always.equal(always_full)  # sinks and the window are held either way


def test_rows_still_landing_are_recorded_as_not_held(monkeypatch):
    """Under `skip` a row whose fetch has not landed is masked from attention: recording it as
    held read skip's lost attention about a sixth too small."""
    from types import SimpleNamespace

    from oasiskv.decode_node.attention import SparseAttention

    monkeypatch.setattr(SparseAttention, "_attend_resident", lambda backend, layer, q: "attended")
    blocks = torch.tensor([[[0, 5, 9, 12]]])  # [layers, kv_heads, rows]
    in_flight = torch.tensor([[[False, False, True, False]]])
    request = SimpleNamespace(ws=SimpleNamespace(blocks=blocks, in_flight=in_flight), positions=torch.tensor([70, 71]))
    sets = ResidentSets()
    with sets.recording():
        assert SparseAttention._attend_resident(SimpleNamespace(requests=[request]), 0, None) == "attended"
    assert sets.blocks[(0, 70)].tolist() == [[0, 5, EMPTY, 12]] == sets.blocks[(0, 71)].tolist()
    assert blocks.tolist() == [[[0, 5, 9, 12]]]  # the working set itself untouched
