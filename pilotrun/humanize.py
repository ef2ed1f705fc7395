"""Numbers as people read them."""
from __future__ import annotations


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def at_length(length: int | None) -> str:
    """" at length 4096", or "" for data with no sequence length (images, tabular rows): never "at length None"."""
    return f" at length {length}" if length else ""


def human_seconds(s: float | None) -> str:
    """3.4e-5 -> "34 µs", 0.42 -> "420 ms", 0.9996 -> "1.00 s" (never "1000 ms"), 9.996 -> "10.0 s",
    119.97 -> "2.0 min".

    Each unit is chosen on the value as it will be printed (rounded), so a value just under a unit's
    limit does not print as that limit in the smaller unit."""
    if s is None:
        return "n/a"
    if 0 < s and round(s * 1e6) < 1000:  # a tiny model's estimated update: "34 µs", not "0 ms"
        return f"{s * 1e6:.0f} µs" if round(s * 1e6) >= 1 else "< 1 µs"
    if round(s * 1000) < 1000:
        return f"{s * 1000:.0f} ms"
    if round(s, 2) < 10:
        return f"{s:.2f} s"
    if round(s, 1) < 120:
        return f"{s:.1f} s"
    if round(s / 60, 1) < 120:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def money(amount: float | None) -> str:
    """A cost in the catalog's currency (prices carry no unit: docs/catalog.md): three significant digits below
    1 (a cost per update is often a fraction of a cent), cents below 100, whole units above."""
    if amount is None:
        return "—"
    if amount < 1:
        return f"{amount:.3g}"
    return f"{amount:,.2f}" if amount < 100 else f"{amount:,.0f}"
