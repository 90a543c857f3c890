"""A table laid out for a terminal: text columns two spaces apart, within a width (120 columns).

Whatever columns the table has, the first `keep` (rank and arm) start every block and the others follow,
as many as fit; a table wider than the terminal becomes blocks one under the other, never wrapped lines.
Labels too long for the arm column are shown as tags (A1, A2, ...) with a legend below that names them.
"""

from __future__ import annotations

WIDTH = 120  # columns of the terminal the table must fit
LONGEST_LABEL = 40  # an arm label longer than this is a tag in the table, named in the legend


def aligned(head: tuple[str, ...] | list[str], rows: list[list[str]]) -> list[str]:
    """Rows as text columns padded to a common width (two spaces apart)."""
    widths = [max(len(row[i]) for row in [list(head), *rows]) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [list(head), *rows]]


def fitted(head: tuple[str, ...] | list[str], rows: list[list[str]], keep: int = 2, label: int = 1,
           width: int = WIDTH, together: tuple[tuple[int, ...], ...] = ()) -> list[str]:  # fmt: skip
    """The table as lines of at most `width` characters (where a cell alone is not wider): blocks of columns,
    each starting with the first `keep`, a blank line between them; then the legend of any tagged labels
    (column `label`). The columns of each `together` group (consecutive indices: a figure, its interval and
    its verdict) go into one block, never split across two."""
    rows = [list(row) for row in rows]
    legend = []
    if any(len(row[label]) > LONGEST_LABEL for row in rows):
        for i, row in enumerate(rows, start=1):
            legend.append(f"A{i}  {row[label]}")
            row[label] = f"A{i}"
    widths = [max(len(str(row[i])) for row in [list(head), *rows]) for i in range(len(head))]
    units = [next((list(g) for g in together if column in g), [column]) for column in range(keep, len(head))]
    blocks: list[list[int]] = []
    for unit in [u for i, u in enumerate(units) if u not in units[:i]]:
        block = blocks[-1] if blocks else None
        if block is None or sum(widths[i] + 2 for i in [*range(keep), *block, *unit]) - 2 > width:
            blocks.append(list(unit))
        else:
            block.extend(unit)
    lines: list[str] = []
    for block in blocks or [[]]:
        columns = [*range(min(keep, len(head))), *block]
        lines += [""] if lines else []
        lines += aligned([head[i] for i in columns], [[row[i] for i in columns] for row in rows])
    return lines + ([""] + legend if legend else [])
