"""Fixed-width text tables for the commands' terminal output, drawn by rich (which vLLM's
environment carries: fastapi[standard] -> typer, rich-toolkit -> rich) with no box, no
colour and no wrapping, so a table reads the same in a terminal, a pipe and a log."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence


def render(
    columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[object]], indent: int = 0
) -> str:
    """The table: ``columns`` are ``(header, "left" | "right")``, two spaces between them,
    each line indented by ``indent`` spaces and stripped of trailing white space."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        box=None,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        header_style="",
        highlight=False,
    )
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(_cell(cell) for cell in row))
    out = io.StringIO()
    console = Console(
        file=out,
        width=1 << 16,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    )
    console.print(table)
    pad = " " * indent
    return "\n".join(pad + line.rstrip() for line in out.getvalue().splitlines())


def _cell(value: object) -> str:
    """One line of printable text: control characters (a newline in an events file's
    field, say) are shown escaped rather than breaking the table."""
    text = str(value)
    return text if text.isprintable() else repr(text)[1:-1]
