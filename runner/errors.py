"""User-facing errors.

A `UserError` is an expected mistake in the user's input (a key, a value, a file). The entry
point prints its message as one paragraph and exits with status 2, without a traceback.
Anything else is a bug in the runner and keeps its traceback.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """An error in the user's input; the message must name the key/file/value and what is valid."""

    exit_code = 2


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Closest names first (difflib ratio), for 'did you mean' hints."""
    choices = list(choices)
    return difflib.get_close_matches(word, choices, n=n, cutoff=0.5)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' or '' when nothing is close."""
    hits = closest(word, choices, n=1)
    return f" Did you mean '{hits[0]}'?" if hits else ""


def valid_list(word: str, choices: Iterable[str]) -> str:
    """All valid names, the closest to `word` first."""
    choices = sorted(set(choices))
    near = closest(word, choices, n=len(choices))
    ordered = near + [c for c in choices if c not in near]
    return ", ".join(ordered)
