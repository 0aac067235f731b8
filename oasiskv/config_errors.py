"""A pydantic ValidationError as a command line reports it: one line per bad field, naming it."""

from __future__ import annotations

from pydantic import ValidationError


def describe(error: ValidationError) -> str:
    """'field: problem (got value)' per error, joined by '; ', without pydantic's URLs."""
    parts = []
    for item in error.errors(include_url=False):
        field = ".".join(str(part) for part in item.get("loc", ()))
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        got = item.get("input")
        shown = f" (got {got!r})" if field and not isinstance(got, (dict, list)) else ""
        parts.append(f"{field}: {message}{shown}" if field else message)
    return "; ".join(parts)
