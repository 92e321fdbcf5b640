"""Byte counts as people read them: the one formatter of every message, table and note that names a size."""
from __future__ import annotations


def size_text(n: int | float) -> str:
    """`512 B`, `3.0 MiB`, `1.5 GiB`: the largest binary unit below which the number stays under 1024."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
