"""`bench/prefix_cache.py` end to end on small sizes: each later chat turn and each later choice
is prefilled from the cache, the first tokens agree, and the results are written."""

import json

import pytest

from bench import prefix_cache


def test_a_small_run_prefills_both_ways_and_writes_the_results(tmp_path):
    prefix_cache.main(["--document-tokens", "200", "--turns", "2", "--turn-tokens", "40", "--choices", "2",
                       "--repeats", "1", "--chunk-tokens", "64", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "prefix_cache_smollm2-135m.json").read_text())
    rows = {r["prompt"]: r for r in results["prompts"]}
    assert [(label, r["prompt_tokens"], r["cached_tokens"]) for label, r in rows.items()] == [
        ("turn 0", 200, 0), ("turn 1", 240, 192), ("choice 0", 200, 0), ("choice 1", 200, 192)]
    assert results["first_tokens_agree"] == "4 of 4"
    for r in rows.values():  # one repeat: its own ratio
        assert r["ratio"] == pytest.approx(r["baseline_runs_s"][0] / r["cached_runs_s"][0])
    assert (tmp_path / "prefix_cache_smollm2-135m.png").stat().st_size > 0


def test_a_cache_of_no_bytes_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        prefix_cache.main(["--cache-gb", "0", "--out", str(tmp_path)])
