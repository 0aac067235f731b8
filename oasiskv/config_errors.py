"""A pydantic ValidationError as a command line reports it: one line per bad field, naming it."""

from __future__ import annotations

import argparse
import re

from pydantic import ValidationError


def describe(error: ValidationError, args: argparse.Namespace | None = None) -> str:
    """'field: problem (got value)' per error, joined by '; ', without pydantic's URLs.

    With the command's parsed `args`, a field set by a flag of the same name is named as the flag
    ('--budget-tokens' rather than 'decode.budget_tokens'), in the location and in the message:
    the user typed the flag, not the field."""
    parts = []
    for item in error.errors(include_url=False):
        loc = [str(part) for part in item.get("loc", ())]
        field = ".".join(loc)
        if args is not None and loc and hasattr(args, loc[-1]):
            field = "--" + loc[-1].replace("_", "-")
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if args is not None:
            message = name_flags(message, args)
            if field and not field.startswith("--") and "--" in message:
                field = ""  # a whole section's check ('decode') that names its flags itself
        got = item.get("input")
        shown = f" (got {got!r})" if field and not isinstance(got, (dict, list)) else ""
        parts.append(f"{field}: {message}{shown}" if field else message)
    return "; ".join(parts)


_FIELD_NAME = re.compile(r"\b(?:[a-z]+\.)?[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")


def name_flags(message: str, args: argparse.Namespace) -> str:
    """`message` with each config field that the command sets from a flag of the same name
    written as that flag."""
    return _FIELD_NAME.sub(lambda m: _as_flag(m.group(0), args), message)


def _as_flag(name: str, args: argparse.Namespace) -> str:
    field = name.rsplit(".", 1)[-1]
    return "--" + field.replace("_", "-") if hasattr(args, field) else name
