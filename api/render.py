"""Plain-text rendering for the CLI: tables and a loss chart that read well in any terminal or CI log."""

from __future__ import annotations

from typing import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def line_chart(values: Sequence[float], *, height: int = 10, width: int = 60, label: str = "loss") -> str:
    """A text chart of `values` against their index (step), downsampled to `width` columns."""
    if not values:
        return f"({label}: no data)"
    n = len(values)
    cols = min(width, n)
    # Column j shows the mean of the values that fall into it.
    buckets = [values[j * n // cols:(j + 1) * n // cols] or [values[-1]] for j in range(cols)]
    ys = [sum(b) / len(b) for b in buckets]
    lo, hi = min(ys), max(ys)
    span = (hi - lo) or 1.0
    levels = [round((y - lo) / span * (height - 1)) for y in ys]
    rows = []
    for h in range(height - 1, -1, -1):
        val = lo + span * h / (height - 1)
        rows.append(f"{val:8.3f} |" + "".join("*" if lv == h else " " for lv in levels))
    rows.append(" " * 9 + "+" + "-" * cols)
    rows.append(" " * 10 + f"step 1{' ' * max(1, cols - 6 - len(str(n)))}{n}")
    return f"{label} by step\n" + "\n".join(rows)
