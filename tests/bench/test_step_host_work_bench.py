"""`bench/step_host_work.py` end to end on small sizes: the old and new drafting and detokenizing
give equal drafts and texts at every step (checked inside the bench), and the results are written."""

import json

import pytest

from bench import step_host_work


def test_a_small_run_times_both_ways_and_writes_the_results(tmp_path):
    step_host_work.main(["--model", "smollm2-135m", "--histories", "2048", "--outputs", "512", "--steps", "20",
                         "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "step_host_work.json").read_text())["rows"]
    assert [(r["work"], r["tokens"], r["steps"]) for r in rows] == [("drafting", 2048, 20), ("detokenizing", 512, 20)]
    for r in rows:
        assert r["baseline_ms"] > 0 and r["candidate_ms"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["candidate_ms"])
    assert (tmp_path / "step_host_work.png").stat().st_size > 0


def test_the_scan_it_replaced_finds_the_latest_longest_match():
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert step_host_work.scan_lookup(history, 2) == [2, 3]
    assert step_host_work.scan_lookup([1, 2, 3], 4) == []


def test_sizes_too_small_for_the_steps_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        step_host_work.main(["--histories", "40", "--steps", "20", "--out", str(tmp_path)])
