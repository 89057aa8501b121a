"""How the CLI prints what it did not write itself: text from data escaped, errors in one line, aligned tables."""

from __future__ import annotations

import re
from typing import Sequence

# C0 and C1 controls, DEL, lone surrogates, line/paragraph separators and bidi overrides: what data can hold that
# would move the cursor, colour the terminal, forge a table row, reorder text or fail to encode when printed.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def escape(text: str, keep: str = "") -> str:
    """``text`` with unprintable characters (but those in ``keep``) written as Python escapes: \\x1b, \\n, \\udc80."""
    return _UNPRINTABLE.sub(lambda m: m.group() if m.group() in keep else repr(m.group())[1:-1], text)


def one_line(message: str, limit: int) -> str:
    """An error message as one escaped line of at most ``limit`` characters. A longer one loses its middle, not
    its end: a message names the problem first and the fix (the command to run) last."""
    message = escape(message)
    if len(message) <= limit:
        return message
    head = (limit - 5) // 2
    return message[:head] + " ... " + message[len(message) - (limit - 5 - head):]


def table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """A plain aligned text table; every cell is one escaped line, so data cannot forge rows or colours."""
    if not rows:
        return "(none)"
    columns = list(columns or rows[0])
    headers = [_fmt(c) for c in columns]
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return escape(str(value))
