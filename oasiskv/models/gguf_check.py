"""Checking that a file is a whole, well-formed GGUF before anything trusts it.

`gguf.GGUFReader` on a damaged file fails with whatever numpy says (a reshape error, an index
error), or not at all when the damage is in the data. This walks the header itself -- it is a
short, simple format -- so it can say exactly what is wrong: bad magic, a header that runs past
the end, a tensor count that does not match, tensor data past the end of the file.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import CorruptModelError

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Far above any real model; a garbage header trips these instead of allocating for ages.
_MAX_COUNT = 10_000_000
_MAX_DIMS = 8

# GGUF metadata value types -> fixed size in bytes (strings and arrays are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorExtent:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    start: int  # absolute file offset of the data
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class GGUFLayout:
    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int
    tensor_count: int  # as the header declares it
    tensors: tuple[TensorExtent, ...]
    architecture: str | None


class _Cursor:
    """Little-endian reads over the mapped file that fail with a message, not an IndexError."""

    def __init__(self, path: Path, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise CorruptModelError(self.path, f"truncated header: file ends inside {what} at byte {self.pos}")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return values[0] if len(values) == 1 else values

    def count(self, what: str) -> int:
        value = self.take("Q", what)
        if value > _MAX_COUNT:
            raise CorruptModelError(self.path, f"corrupted header: implausible {what} {value} at byte {self.pos - 8}")
        return value

    def string(self, what: str) -> str:
        length = self.take("Q", f"length of {what}")
        if self.pos + length > self.size:
            raise CorruptModelError(
                self.path, f"truncated header: {what} of {length} bytes at byte {self.pos} runs past the end"
            )
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptModelError(
                self.path, f"corrupted header: {what} at byte {self.pos - length} is not UTF-8"
            ) from None

    def skip_value(self, value_type: int, what: str) -> None:
        if value_type in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[value_type], what)
        elif value_type == _STRING:
            self.string(what)
        elif value_type == _ARRAY:
            item_type = self.take("I", f"item type of {what}")
            n = self.count(f"length of {what}")
            if item_type in _SCALAR_SIZES:
                self.skip(_SCALAR_SIZES[item_type] * n, what)
            else:
                for _ in range(n):
                    self.skip_value(item_type, what)
        else:
            raise CorruptModelError(self.path, f"corrupted header: unknown value type {value_type} for {what}")

    def skip(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise CorruptModelError(self.path, f"truncated header: file ends inside {what} at byte {self.pos}")
        self.pos += n


def scan_gguf(path: str | Path) -> GGUFLayout:
    """Parse the header and tensor table; raise CorruptModelError on anything malformed."""
    path = Path(path)
    try:
        size = path.stat().st_size
        handle = open(path, "rb")
    except OSError as exc:
        raise CorruptModelError(path, f"cannot be read ({exc.strerror or exc})") from exc
    with handle:
        if size < 4:
            raise CorruptModelError(path, f"bad magic: file is only {size} bytes")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(path, buf, size)


def _scan(path: Path, buf, size: int) -> GGUFLayout:
    cur = _Cursor(path, buf, size)
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise CorruptModelError(path, f"bad magic {magic!r}: not a GGUF file (expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.take("I", "version")
    if version not in (2, 3):
        raise CorruptModelError(path, f"unsupported or corrupted GGUF version {version} (expected 2 or 3)")
    tensor_count = cur.count("tensor count")
    kv_count = cur.count("metadata count")

    alignment, architecture = _DEFAULT_ALIGNMENT, None
    for index in range(kv_count):
        key = cur.string(f"metadata key #{index}")
        value_type = cur.take("I", f"type of {key}")
        if key == "general.alignment" and value_type == 4:
            alignment = cur.take("I", key)
        elif key == "general.architecture" and value_type == _STRING:
            architecture = cur.string(key)
        else:
            cur.skip_value(value_type, key)
    if alignment <= 0 or alignment & (alignment - 1):
        raise CorruptModelError(path, f"corrupted header: alignment {alignment} is not a power of two")

    infos = []
    for index in range(tensor_count):
        name = cur.string(f"name of tensor #{index}")
        n_dims = cur.take("I", f"rank of {name}")
        if n_dims == 0 or n_dims > _MAX_DIMS:
            raise CorruptModelError(path, f"corrupted header: tensor {name!r} has rank {n_dims}")
        shape = tuple(cur.take("Q", f"shape of {name}") for _ in range(n_dims))
        ggml_type = cur.take("I", f"type of {name}")
        offset = cur.take("Q", f"offset of {name}")
        infos.append((name, shape, ggml_type, offset))
    data_offset = -(-cur.pos // alignment) * alignment

    tensors = tuple(_extent(path, data_offset, *info) for info in infos)
    return GGUFLayout(path, version, size, alignment, data_offset, tensor_count, tensors, architecture)


def _extent(path: Path, data_offset: int, name: str, shape: tuple[int, ...], ggml_type: int, offset: int):
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise CorruptModelError(path, f"corrupted header: tensor {name!r} has unknown type {ggml_type}") from None
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    if shape[0] % block:
        raise CorruptModelError(path, f"corrupted header: tensor {name!r} rows of {shape[0]} are not whole blocks")
    return TensorExtent(name, ggml_type, shape, data_offset + offset, n_elements // block * type_size)


def check_layout(layout: GGUFLayout) -> None:
    """Every declared tensor lies inside the file, and the file is not longer than they need."""
    path, size = layout.path, layout.file_size
    readable = [t for t in layout.tensors if t.end <= size]
    if len(readable) != layout.tensor_count:
        first_bad = next(t for t in layout.tensors if t.end > size)
        raise CorruptModelError(
            path,
            f"truncated: header declares {layout.tensor_count} tensors but only {len(readable)} are readable; "
            f"tensor data past end of file (tensor {first_bad.name!r} ends at byte {first_bad.end}, "
            f"file has {size})",
        )
    names = [t.name for t in layout.tensors]
    if len(set(names)) != len(names):
        raise CorruptModelError(path, "corrupted header: duplicate tensor names")
    end = max((t.end for t in layout.tensors), default=layout.data_offset)
    # llama.cpp pads each tensor, the last one too, to the alignment; more than that is a sign of
    # parts concatenated wrongly (one twice, or a stray file).
    if size - end >= layout.alignment:
        raise CorruptModelError(path, f"size mismatch: {size - end} unexpected bytes after the last tensor")


def verify_gguf(path: str | Path, expected_sha256: str | None = None, actual_sha256: str | None = None) -> GGUFLayout:
    """Structural check, plus the checksum when one is known. Returns the parsed layout."""
    path = Path(path)
    if expected_sha256:
        digest = actual_sha256 or sha256_file(path)
        if digest.lower() != expected_sha256.lower():
            raise CorruptModelError(path, f"sha256 mismatch: got {digest}, expected {expected_sha256}")
    layout = scan_gguf(path)
    check_layout(layout)
    return layout


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
