"""`bench/miss_policy.py` (through `bench/sparse_quality.py --read-delay-ms`) end to end on SmolLM2
with slowed store reads: both miss policies run beside dense on the same text, and the results
count what each did with the late prefetches."""

import json

import pytest

from bench import miss_policy, sparse_quality
from bench.common import DelayedReads


def test_a_slow_link_makes_wait_block_and_skip_skip(tmp_path):
    miss_policy.main(["--model", "smollm2-135m", "--context", "1024", "--new-tokens", "24", "--budget-tokens", "256",
                      "--offsets", "0", "--delays-ms", "40", "--out", str(tmp_path)])
    per_delay = json.loads((tmp_path / "sparse_quality_smollm2-135m_miss_policy_delay40.json").read_text())
    assert per_delay["read_delay_ms"] == 40
    runs = {row["mode"]: row for row in json.loads((tmp_path / "miss_policy_smollm2-135m.json").read_text())["runs"]}
    assert set(runs) == {"dense", "lookahead", "lookahead+skip"}
    wait, skip = runs["lookahead"], runs["lookahead+skip"]
    assert (wait["miss_policy"], skip["miss_policy"]) == ("wait", "skip")
    assert wait["prefetch_waits"] > 0 and wait["prefetch_skips"] == 0
    assert skip["prefetch_skips"] > 0 and skip["prefetch_waits"] == 0
    assert runs["dense"]["prefetch_waits"] == runs["dense"]["prefetch_skips"] == 0
    for row in runs.values():
        assert 0 <= row["top1_agreement"] <= 1 and row["perplexity_ratio"] > 0
    assert (tmp_path / "miss_policy_smollm2-135m.png").exists()


def test_reusing_results_that_are_not_there_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        miss_policy.main(["--reuse", "--delays-ms", "7", "--out", str(tmp_path)])
    assert "miss_policy_delay7.json is missing" in capsys.readouterr().err


def test_a_negative_read_delay_is_refused(capsys):
    with pytest.raises(SystemExit):
        sparse_quality.main(["--quick", "--read-delay-ms", "-5"])
    assert "--read-delay-ms must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        miss_policy.main(["--delays-ms", "10,-5"])
    assert "--delays-ms must be >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="read delay must be >= 0"):
        DelayedReads(object(), -0.1)
