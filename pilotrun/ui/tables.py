"""Tables that keep one line per row at any width (issue 46): long per-row notes become numbered footnotes under the
table, no cell wraps, and when the console is still too narrow whole columns are left out, named in a line under
the table, rather than a row spread over many lines. Pure: rows in, a rich Table and the lines to print out."""
from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

Cell = str | Text

# A note this long or shorter stays in its cell; a longer one becomes "[n]" with its text once under the table.
NOTE_LIMIT = 24


@dataclass(frozen=True)
class Column:
    """One column. ``drop``: 0 never left out; otherwise the order columns go when the table is too wide for the
    console (the highest first, the rightmost of equals first)."""
    header: str
    justify: Literal["left", "right"] = "left"
    drop: int = 0
    whole: bool = False  # never cut (an id people copy): the other columns give way when nothing is left to leave out


class Footnotes:
    """Numbered notes, each text once: ``cell`` keeps a short note in place and cuts a long one to its first words
    and its mark ("20 updates x 1.2 s (each… [3]"), or to the mark alone when ``limit`` leaves no room for words."""

    def __init__(self, limit: int = NOTE_LIMIT) -> None:
        self.limit = limit
        self._numbers: dict[str, int] = {}

    def mark(self, text: str) -> str:
        number = self._numbers.setdefault(text, len(self._numbers) + 1)
        return f"[{number}]"

    def cell(self, text: str) -> str:
        if len(text) <= self.limit:
            return text
        mark = self.mark(text)
        room = self.limit - len(mark) - 2
        head = text[:room + 1]  # one more: a word that ends at the room is whole
        lead = (head.rsplit(" ", 1)[0] if " " in head else head[:room]).rstrip(" ,;:(") if room >= 12 else ""
        return f"{lead}… {mark}" if lead else mark

    def lines(self) -> list[str]:
        return [f"[{n}] {text}" for text, n in self._numbers.items()]


def natural_width(table: Table) -> int:
    """The columns the table takes when nothing in it wraps or is cut."""
    console = Console(width=100_000, file=io.StringIO(), color_system=None)
    return Measurement.get(console, console.options, table).maximum


def _build(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], keep: list[int], **table_args) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left", **table_args)
    cells = [[c if isinstance(c, Text) else Text(str(c)) for c in row] for row in rows]  # Text: a name may hold "[x]"
    for i in keep:
        whole = max([cells_[i].cell_len for cells_ in cells] + [len(columns[i].header)]) if columns[i].whole else None
        # no_wrap: a cell too wide for what is left is cut with "…", never spread over lines.
        table.add_column(columns[i].header, justify=columns[i].justify, no_wrap=True, overflow="ellipsis",
                         min_width=whole)
    for row_cells in cells:
        table.add_row(*(row_cells[i] for i in keep))
    return table


def fit_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int,
              **table_args) -> tuple[Table, list[str]]:
    """A table of ``rows`` no wider than ``width`` where it can be: droppable columns are left out, in their
    ``drop`` order, until it fits. Returns the table and the headers left out."""
    keep = list(range(len(columns)))
    while True:
        table = _build(columns, rows, keep, **table_args)
        droppable = [i for i in keep if columns[i].drop]
        if natural_width(table) <= width or not droppable:
            return table, [c.header for i, c in enumerate(columns) if i not in keep]
        keep.remove(max(droppable, key=lambda i: (columns[i].drop, i)))


def fit_noted(columns: Sequence[Column], make_rows: Callable[[Footnotes], list[list[Cell]]], width: int,
              limits: Sequence[int] = (40, 24, 8), **table_args) -> tuple[Table, list[str], Footnotes]:
    """``fit_table`` for rows with long notes: each note whole in its cell where the table fits so; else cut to
    ``limits[0]`` characters and a footnote, and so on; columns are left out only when the last limit is not enough.
    ``make_rows`` builds the rows with the footnotes it is given."""
    for limit in (width, *limits):
        notes = Footnotes(limit)
        table, dropped = fit_table(columns, make_rows(notes), width, **table_args)
        if not dropped and natural_width(table) <= width:
            break
    return table, dropped, notes


def left_out_line(dropped: Sequence[str], width: int, more: str = "--json") -> str | None:
    """Says which columns a narrow console cost, and how to see them."""
    if not dropped:
        return None
    return f"left out at {width} columns: {', '.join(dropped)} (a wider terminal or {more} shows them)"


def print_table(console: Console, table: Table, dropped: Sequence[str] = (), notes: Footnotes | None = None,
                more: str = "--json") -> None:
    """The table, then what it left out and its footnotes, dim."""
    console.print(table)
    line = left_out_line(dropped, console.width, more)
    for text in ([line] if line else []) + (notes.lines() if notes else []):
        console.print(Text(text, style="dim"))
