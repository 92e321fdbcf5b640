"""--checkpoint-interval grammar (same as the SPANK shim's duration.c)."""
from __future__ import annotations

import pytest

from slurmckpt.duration import MIN_INTERVAL_S, parse_duration


@pytest.mark.parametrize("text,seconds", [
    ("off", 0), ("OFF", 0), ("0", 0), ("0m", 0), ("00:00", 0),
    ("30", 1800),            # bare number = minutes, like sbatch --time
    ("30m", 1800), ("90s", 90), ("1h30m", 5400), ("2d", 172800), ("1d2h3m4s", 93784),
    ("10s", MIN_INTERVAL_S),
    ("05:00", 300), ("1:02:03", 3723), ("100:00:00", 360000),
])
def test_accepted(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1.5h", "-5m", "m", "5x", "1h 30m", "1:2:3:4", "h1", "30 m",
                                  "1:-1", ":30", "none", " 1h", "1H"])
def test_rejected_names_the_value(text):
    with pytest.raises(ValueError) as e:
        parse_duration(text)
    assert f"'{text}'" in str(e.value)


@pytest.mark.parametrize("text", ["1:60", "0:99", "1:00:60", "1:60:00"])
def test_minutes_and_seconds_below_60(text):
    with pytest.raises(ValueError, match="below 60"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["9s", "1s", "00:05", "0:09"])
def test_below_minimum_is_refused_not_rounded(text):
    with pytest.raises(ValueError, match="minimum"):
        parse_duration(text)


def test_large_hours_field_not_limited():
    assert parse_duration("48:00:00") == 48 * 3600


# The same grammar as the SPANK shim (spank/duration.c): otherwise sbatch accepts a value the wrapper rejects.
@pytest.mark.parametrize("text", ["30m1h", "1m1m", "366d"])
def test_same_rejections_as_the_shim(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_same_acceptance_as_the_shim():
    assert parse_duration("1:005") == 65
