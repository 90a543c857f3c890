"""The one error a run configuration raises: ConfigError, whose message is one line; and `shown`, a value as such
a line echoes it."""

from typing import Any

SHOWN_MAX = 80  # characters of a value a refusal echoes; a longer one is cut in the middle, its length said


class ConfigError(ValueError):
    """A run configuration that cannot be trained; the message is one line."""


def shown(value: Any) -> str:
    """`value`'s repr as a refusal echoes it: whole up to SHOWN_MAX characters, else its start and end around
    how many characters were left out (a 5,000-character name= is not echoed whole)."""
    text = repr(value)
    if len(text) <= SHOWN_MAX:
        return text
    left_out = len(text) - SHOWN_MAX + 20
    return f"{text[:SHOWN_MAX // 2]}…[{left_out} characters]…{text[-(SHOWN_MAX // 2 - 20):]}"
