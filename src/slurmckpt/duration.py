"""--checkpoint-interval values: exactly the grammar of the SPANK shim's spank/duration.c (`parse_interval`,
the one Python parser of it; `slurmckpt checkpoint` uses it to tell whether a job's interval is on), and the
durations of the site policy and config (`parse_duration`: the same grammar without `auto`)."""
from __future__ import annotations

import re

MIN_INTERVAL_S = 10
MAX_INTERVAL_S = 365 * 86400
_SCALE = {"d": 86400, "h": 3600, "m": 60, "s": 1}
# --checkpoint-interval=auto: the job's coordinator chooses the interval from the measured stall of its captures
# and the partition's interruption rate (coordinator/interval.py). Passed as "auto" in the agent's argv and
# SLURMCKPT_INTERVAL, as this value everywhere else.
AUTO = -1
_FORMAT = "expected off, 0, N (minutes), units like 90s, 30m, 1h30m, 2d, or MM:SS / HH:MM:SS"
_INTERVAL_FORMAT = ("expected off, auto, 0, N (minutes), units like 90s, 30m, 1h30m, 2d, or MM:SS / "
                    "HH:MM:SS")


def parse_interval(text: str) -> int:
    """A --checkpoint-interval value (spank/duration.c): `auto` (any case) is AUTO, anything else as
    parse_duration. Raises ValueError naming the bad value and the reason."""
    if text.lower() == "auto":
        return AUTO
    return _parse(text, _INTERVAL_FORMAT)


def parse_duration(text: str) -> int:
    """Seconds for `text`; 0 means disabled. Raises ValueError naming the bad value and the reason.

    Accepted: off (any case) | N (minutes) | [Nd][Nh][Nm][Ns] (each unit once, in this order) | M:S | H:M:S
    (fields after a ':' below 60); a total of 0 is off; otherwise 10 s .. 365 d.
    """
    return _parse(text, _FORMAT)


def interval_arg(text: str) -> int:
    """The interval as the shim writes it into the agent's argv and SLURMCKPT_INTERVAL: seconds, or auto."""
    return AUTO if text == "auto" else int(text or 0)


def _parse(text: str, form: str) -> int:
    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid --checkpoint-interval value '{text}': {reason}")

    if text == "":
        raise bad("empty value")
    if text.lower() == "off":
        return 0
    if ":" in text:
        fields = text.split(":")
        if len(fields) > 3 or not all(f.isdigit() and f.isascii() for f in fields):
            raise bad(form)
        if any(int(f) >= 60 for f in fields[1:]):
            raise bad("minutes and seconds after a ':' must be below 60")
        total = 0
        for f in fields:
            total = total * 60 + int(f)
    elif text.isdigit() and text.isascii():
        total = int(text) * 60
    else:
        parts = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
        if not parts or not any(parts.groups()):
            if re.fullmatch(r"(\d+[dhms])+", text):
                raise bad("each unit may appear once, in the order d, h, m, s")
            raise bad(form)
        total = sum(int(n) * _SCALE[u] for n, u in zip(parts.groups(), "dhms") if n)
    if total == 0:
        return 0
    if total > MAX_INTERVAL_S:
        raise bad("too large (maximum 365d)")
    if total < MIN_INTERVAL_S:
        raise bad("below the minimum of 10 seconds (use off to disable)")
    return total


def format_interval(seconds: int) -> str:
    """As format_duration, and AUTO as auto."""
    return "auto" if seconds == AUTO else format_duration(seconds)


def format_duration(seconds: int) -> str:
    """The shortest unit spelling the grammar above reads back: 5400 -> 1h30m, 0 -> off."""
    if seconds <= 0:
        return "off"
    out = ""
    for unit, scale in _SCALE.items():
        if seconds >= scale:
            out += f"{seconds // scale}{unit}"
            seconds %= scale
    return out
