"""bench/pd_throughput.py refuses what it cannot run by name, before any server starts (a 0
silently meant the default; --repeats 0 ended in an IndexError after both servers ran)."""

import pytest

from bench.pd_throughput import main


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats: must be at least 1, got 0"),
    (["--num-requests", "0"], "--num-requests: must be at least 1, got 0"),
    (["--max-tokens", "1"], "--max-tokens: must be at least 2"),
    (["--kv-pool-gb", "0"], "--kv-pool-gb must be positive, got 0.0"),
    (["--budget-tokens", "100"], "--budget-tokens must be a multiple of 16, got 100"),
    (["--poll-s", "0"], "--poll-s must be positive"),
])
def test_a_bad_argument_is_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "no-such-model", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
