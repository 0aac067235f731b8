"""What `bench/lookahead_accuracy.py` counts as a candidate block, and the runs it refuses before
loading a model: a run where the top-K holds every candidate reports 100% recall for every
predictor and "goal met", whatever the predictors do."""

import pytest

from bench.lookahead_accuracy import candidate_mask, main


def test_a_sliding_window_layer_has_no_candidate_it_cannot_see():
    # Query at 1,000, window 512: keys from 489 on are visible, so blocks from 30 (480..495) on.
    full = candidate_mask(1000, 1, 4)
    sliding = candidate_mask(1000, 1, 4, sliding_window=512)
    assert full.numel() == sliding.numel() == 59  # the window starts at block 62 - 4 + 1
    assert int(full.sum()) == 58 and bool(full[1]) and not bool(full[0])
    assert not sliding[:30].any() and sliding[30:].all()
    # A window reaching back past the sinks hides nothing.
    assert candidate_mask(1000, 1, 4, sliding_window=4096).equal(full)


@pytest.mark.parametrize("argv, message", [
    (["--budget-tokens", "0"], "--budget-tokens: must be at least 16, got 0"),
    (["--budget-tokens", "100"], "multiple of the block size 16"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens: must be at least 1"),
    (["--positions", "0"], "--positions: must be at least 1"),
    (["--contexts", "2048,x"], "--contexts: 'x' is not a whole number"),
    (["--contexts", "20"], "context 20 is too short for 24 positions"),
    # The default 2,048-token budget over a 1,024-token context: it printed "goal met".
    (["--contexts", "1024"], "would hold them all, so every recall would be 100%"),
    (["--contexts", "8192", "--budget-tokens", "131072"], "would hold them all"),
])
def test_runs_that_cannot_measure_recall_are_refused_before_the_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "no-such-model", *argv])  # a model load would fail differently
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
