"""One-line errors: what a user sees when normlab refuses something."""

from __future__ import annotations

import sys

PREFIX = "normlab: error: "


def one_line(err: BaseException | str, limit: int = 300) -> str:
    """An error's text on one line (its whitespace folded), cut to `limit` characters; the type's name if it has no text."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(err: BaseException | str) -> int:
    """Print `normlab: error: <err>` to stderr and return the exit code for bad input, 2."""
    print(PREFIX + str(err), file=sys.stderr)
    return 2
