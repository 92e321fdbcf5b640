"""--checkpoint-interval values: the same grammar as the SPANK shim's duration.c."""
from __future__ import annotations

import re

MIN_INTERVAL_S = 10
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+)([smhd])")


def parse_duration(text: str) -> int:
    """Seconds for `text`; 0 means disabled. Raises ValueError naming the bad value.

    Accepted: off | 0 | N (minutes) | 1h30m / 90s / 2d (unit sequences) | MM:SS | HH:MM:SS.
    """
    value = text.strip().lower()
    if value in ("off", "0", "none"):
        return 0
    if value.isdigit():
        seconds = int(value) * 60
    elif re.fullmatch(r"\d+(:\d{1,2}){1,2}", value):
        fields = [int(f) for f in value.split(":")]
        if any(f >= 60 for f in fields[1:]):
            raise ValueError(f"invalid duration '{text}': minutes and seconds must be < 60")
        seconds = 0
        for f in fields:
            seconds = seconds * 60 + f
    elif re.fullmatch(r"(\d+[smhd])+", value):
        seconds = sum(int(n) * _UNITS[u] for n, u in _PART.findall(value))
    else:
        raise ValueError(
            f"invalid duration '{text}': expected off, N (minutes), e.g. 30m, 1h30m, 90s, MM:SS or HH:MM:SS")
    if seconds == 0:
        return 0
    if seconds < MIN_INTERVAL_S:
        raise ValueError(f"invalid duration '{text}': minimum is {MIN_INTERVAL_S}s")
    return seconds
