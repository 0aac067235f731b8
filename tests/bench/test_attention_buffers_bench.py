"""`bench/attention_buffers.py` end to end on tiny shapes: both variants run, their outputs are
checked equal inside the bench, and the JSON and plot are written."""

import json
import sys

import pytest

from bench import attention_buffers


def test_a_tiny_run_writes_both_variants(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["attention_buffers.py", "--contexts", "256,512", "--layers", "2",
                                      "--repeats", "2", "--out", str(tmp_path)])
    attention_buffers.main()
    results = json.loads((tmp_path / "attention_buffers.json").read_text())
    assert [(e["context"], e["dtype"], e["rows"]) for e in results["configs"]] == [
        (c, d, r) for c in (256, 512) for d in ("float32", "bfloat16") for r in (1, 4)]
    for entry in results["configs"]:
        assert entry["fresh_s"] > 0 and entry["reused_s"] > 0
        assert entry["ratio"] == pytest.approx(entry["fresh_s"] / entry["reused_s"])
    assert (tmp_path / "attention_buffers.png").stat().st_size > 0


def test_an_unknown_dtype_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attention_buffers.py", "--dtypes", "float16", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        attention_buffers.main()
    assert "unknown dtype" in capsys.readouterr().err
