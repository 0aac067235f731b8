"""What can go wrong when getting a model, as exceptions a user can act on.

Each one says which model or file it is about and what failed, so the CLI can print the message
and exit without a traceback from deep inside pip or gguf.
"""

from __future__ import annotations

from pathlib import Path


class ModelError(Exception):
    """Base of the errors raised while pulling, verifying or converting a model.

    Subclasses keep the arguments they were built from in `_built_from`: pickling (Ray ships a
    worker's exception to the caller) rebuilds an exception from its args, which here are the
    formatted message, not the constructor's arguments, and a worker's error would otherwise
    arrive as Ray's UnserializableException instead of this message."""

    _built_from: tuple = ()

    def __reduce__(self):
        if not self._built_from:
            return super().__reduce__()
        return (type(self), self._built_from, self.__dict__)


class UnknownModelError(ModelError, KeyError):
    def __init__(self, name: str, known: list[str] | tuple[str, ...]):
        self.name = name
        self.known = tuple(known)
        self._built_from = (name, self.known)
        super().__init__(name)

    def __str__(self) -> str:
        return (
            f"unknown model {self.name!r}: not a registry name, a Hugging Face directory "
            f"or a .gguf file; known names: {', '.join(self.known)}"
        )


class CorruptModelError(ModelError, ValueError):
    """A file is not what it should be: bad magic, checksum mismatch, truncation, bad header."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self.problem = problem
        self._built_from = (path, problem)
        super().__init__(f"{self.path}: {problem}")


class ModelPullError(ModelError, RuntimeError):
    """Fetching the model's packages failed (pip's own words are kept at the end)."""

    def __init__(self, message: str, stderr: str = ""):
        self.stderr = stderr
        self._built_from = (message, stderr)
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        super().__init__(f"{message}\n--- pip said ---\n{tail}" if tail else message)


class UnsupportedGGUFError(ModelError, ValueError):
    """A well-formed GGUF whose architecture or layout this converter does not handle."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self._built_from = (path, problem)
        super().__init__(f"{self.path}: {problem}")
