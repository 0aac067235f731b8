"""`bench/attention_core.py` end to end on tiny shapes: both cores run, each is checked against a
float64 reference, and the JSON and plot are written."""

import json
import sys

import pytest

from bench import attention_core


def test_a_tiny_run_times_both_cores_and_their_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["attention_core.py", "--contexts", "256", "--layers", "2", "--head-dim", "64",
                                      "--repeats", "2", "--out", str(tmp_path)])
    attention_core.main()
    results = json.loads((tmp_path / "attention_core.json").read_text())
    assert [(e["context"], e["dtype"], e["rows"]) for e in results["configs"]] == [
        (256, d, r) for d in ("bfloat16", "float32") for r in (1, 4)]
    for entry in results["configs"]:
        assert entry["ratio"] == pytest.approx(entry["baseline_s"] / entry["sdpa_s"])
        # Both within rounding of the model's dtype: bf16 keeps 8 bits, fp32 24.
        bound = 1e-2 if entry["dtype"] == "bfloat16" else 1e-5
        assert entry["baseline_max_error"] < bound and entry["sdpa_max_error"] < bound
    assert (tmp_path / "attention_core.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [(["--dtypes", "float16"], "unknown dtype"), (["--rows", "17"], "1 to 16")])
def test_bad_options_are_refused(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["attention_core.py", *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        attention_core.main()
    assert message in capsys.readouterr().err
