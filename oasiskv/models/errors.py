"""What can go wrong when getting a model, as exceptions a user can act on.

Each one says which model or file it is about and what failed, so the CLI can print the message
and exit without a traceback from deep inside pip or gguf.
"""

from __future__ import annotations

from pathlib import Path


class ModelError(Exception):
    """Base of the errors raised while pulling, verifying or converting a model."""


class UnknownModelError(ModelError, KeyError):
    def __init__(self, name: str, known: list[str] | tuple[str, ...]):
        self.name = name
        self.known = tuple(known)
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
        super().__init__(f"{self.path}: {problem}")


class ModelPullError(ModelError, RuntimeError):
    """Fetching the model's packages failed (pip's own words are kept at the end)."""

    def __init__(self, message: str, stderr: str = ""):
        self.stderr = stderr
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        super().__init__(f"{message}\n--- pip said ---\n{tail}" if tail else message)


class UnsupportedGGUFError(ModelError, ValueError):
    """A well-formed GGUF whose architecture or layout this converter does not handle."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        super().__init__(f"{self.path}: {problem}")
