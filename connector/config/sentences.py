"""The validator's findings as KVLens's sentences: key, where it came from, what is wrong.

Pydantic's own messages ("Input should be ...", "Extra inputs are not permitted") never reach
a user; every error type KVLens's model can raise has a sentence here, and any other gets a
plain one. Values are shown short, and never for a key that holds a secret.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

_SECRET_WORDS = ("password", "secret", "token", "access_key")


def short(value: Any, limit: int = 40) -> str:
    """A value as a message shows it: repr, cut to ``limit`` characters."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an integer past the int-to-str limit, deep nesting
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(
    error: ValidationError,
    sources: Mapping[str, str],
    extra_sources: Mapping[str, str],
    whole: bool = True,
) -> list[str]:
    """One sentence per problem the validator found, naming the key and its source; ``whole``:
    also problems of the configuration as a whole (no storage tier, a budget of 0)."""
    out = []
    for item in error.errors(include_url=False):
        loc = [str(p) for p in item["loc"]]
        if not loc:
            if whole:
                out.append(_model_problem(item))
            continue
        if loc[0] == "extra_config" and len(loc) > 1:
            key, source = "extra_config." + loc[1], extra_sources.get(loc[1], "")
        else:
            key, source = loc[0], sources.get(loc[0], "")
        where = f" (from {source})" if source else ""
        shown = "" if _secret(key) else f", not {short(item.get('input'))}"
        out.append(f"{key}{where} {_phrase(item)}{shown}")
    return out


def _model_problem(item: Mapping[str, Any]) -> str:
    error = (item.get("ctx") or {}).get("error")
    return str(error) if error is not None else "the configuration is not valid"


def _phrase(item: Mapping[str, Any]) -> str:
    kind = item["type"]
    ctx = item.get("ctx") or {}
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "must be a whole number"
    if kind in ("float_parsing", "float_type"):
        return "must be a number"
    if kind == "finite_number":
        return "must be a finite number"
    if kind in ("bool_parsing", "bool_type"):
        return "must be true or false"
    if kind in ("string_type", "string_unicode"):
        return "must be text"
    if kind == "string_pattern_mismatch":
        return "may hold only letters, digits, '_', '.' and '-'"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        word = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
        bound = next(iter(ctx.values()), "?")
        return f"must be {word[kind]} {bound}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', 'the allowed values')}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a mapping of keys"
    if kind in ("list_type", "tuple_type"):
        return "must be a list"
    if kind == "none_required":
        return "must be null"
    if kind == "value_error":
        return str(ctx.get("error", "is not valid"))
    if kind == "extra_forbidden":
        return "is not a key KVLens knows"
    if kind == "missing":
        return "is required"
    return "has a value KVLens cannot use"


def _secret(key: str) -> bool:
    return any(word in key.lower() for word in _SECRET_WORDS)
