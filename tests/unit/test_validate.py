"""validate.py: every value that crosses from the user side is finite, bounded and of its one shape."""
from __future__ import annotations

import json
import math
import time

import pytest

from slurmckpt import validate
from slurmckpt.errors import ProtocolError

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad", [NAN, INF, -INF, -1, 120.5, 1e308, "5", None, True, [1]])
def test_wait_s_refuses_non_finite_negative_huge_and_non_numbers(bad):
    with pytest.raises(ProtocolError, match="wait_s"):
        validate.wait_s(bad)


@pytest.mark.parametrize("good", [0, 0.5, 3, 120])
def test_wait_s_accepts_bounded_numbers(good):
    assert validate.wait_s(good) == float(good)


def test_the_old_wait_s_parse_hangs_on_nan():
    """What agent.op_lookup_coordinator did: min(float(x), 120) keeps NaN, and no time is ever past it."""
    deadline = time.monotonic() + min(float("nan"), 120.0)
    assert not time.monotonic() + 10**9 >= deadline          # the agent's loop would never end
    assert min(float("-inf"), 120.0) == -INF                  # (and -inf / huge negatives slipped through too)


@pytest.mark.parametrize("bad", [0, -1, 10**6, 2**70, 1.0, NAN, "1", None, True, False])
def test_epoch(bad):
    with pytest.raises(ProtocolError, match="epoch"):
        validate.epoch(bad)
    assert validate.epoch(1) == 1 and validate.epoch(999_999) == 999_999


@pytest.mark.parametrize("name,parsed", [("batch.0", ("batch", 0)), ("0.0", ("0", 0)), ("12.345", ("12", 345)),
                                         ("4294967040.99999", ("4294967040", 99999))])
def test_rank_name_accepts_step_dot_rank(name, parsed):
    assert validate.rank_name(name) == parsed


@pytest.mark.parametrize("bad", ["../etc.0", "batch.-1", "batch", "batch.", ".0", "0.01", "01.0", "0.1.2",
                                 "x.0", "batch.0/..", "batch.0\n", " 0.0", "0.0 ", "0.１", "٣.0", "0.100000",
                                 "99999999999.0", "4294967295.0", "0." + "9" * 40, 5, None, ["0.0"]])
def test_rank_name_refuses_everything_else(bad):
    with pytest.raises(ProtocolError, match="rank"):
        validate.rank_name(bad)


@pytest.mark.parametrize("bad", ["../x", "1/2", "-1", "batch", "", "0x1", "1e3", 3, None])
def test_scope(bad):
    with pytest.raises(ProtocolError, match="scope"):
        validate.scope(bad)
    assert validate.scope("job") == "job" and validate.scope("7") == "7"


def test_step_and_rank_index():
    assert validate.step("batch") == "batch" and validate.step("0") == "0"
    for bad in ("extern", "4294967295", "-0", "1 ", 1):
        with pytest.raises(ProtocolError, match="step"):
            validate.step(bad)
    for bad in (-1, validate.MAX_TASKS, 1.0, "0", True):
        with pytest.raises(ProtocolError, match="rank"):
            validate.rank_index(bad)


@pytest.mark.parametrize("bad", ["0.0.0.0.0", "evil.example", "", "::1%lo", "0.0.0.0", "224.0.0.1", "1.2.3",
                                 "1" * 100, 1, None])
def test_ip_address(bad):
    with pytest.raises(ProtocolError, match="host"):
        validate.ip_address(bad)
    assert validate.ip_address("127.0.0.1") == "127.0.0.1" and validate.ip_address("::1") == "::1"


def test_port_token_nonce():
    for bad in (0, 65536, -1, 80.0, "80", NAN, True):
        with pytest.raises(ProtocolError, match="port"):
            validate.port(bad)
    assert validate.port(1) == 1 and validate.port(65535) == 65535
    for bad in ("a" * 63, "A" * 64, "g" * 64, "a" * 65, 0, None):
        with pytest.raises(ProtocolError, match="token"):
            validate.token(bad)
    assert validate.token("0f" * 32)
    for bad in ("a" * 31, "a" * 33, "../" * 11, 7):
        with pytest.raises(ProtocolError, match="nonce"):
            validate.nonce(bad)


def test_labels_hostnames_text_flags():
    assert validate.label("manual-requeue", "reason") == "manual-requeue"
    for bad in ("", "a b", "x\x1b[2J", "a" * 65, "-x", 3, None):
        with pytest.raises(ProtocolError, match="reason"):
            validate.label(bad, "reason")
    assert validate.hostname("node1") == "node1" and validate.hostname("node-0.0") == "node-0.0"
    for bad in ("", "a/b", "n\n", "a" * 300, 1):
        with pytest.raises(ProtocolError, match="node"):
            validate.hostname(bad)
    assert validate.text("criu failed\nline 2", "reason") == "criu failed\nline 2"
    for bad in ("x" * (validate.MAX_TEXT + 1), 1, None, {"a": 1}):
        with pytest.raises(ProtocolError, match="reason"):
            validate.text(bad, "reason")
    for bad in (1, 0, "true", None):
        with pytest.raises(ProtocolError, match="final"):
            validate.flag(bad, "final")
    assert validate.flag(False, "final") is False


def test_number_and_integer_bounds():
    assert validate.number(1, "x", 0, 2) == 1.0
    for bad in (NAN, INF, -INF, 3, -0.5):
        with pytest.raises(ProtocolError, match="bad x"):
            validate.number(bad, "x", 0, 2)
    with pytest.raises(ProtocolError, match="bad n"):
        validate.integer(2**80, "n", 0, 10)


def test_commit_ranks_records():
    good = {"batch.0": {"kind": "image", "node": "node1"},
            "0.1": {"kind": "completed", "exit_code": 3, "node": "node2"}, "0.2": {"kind": "replay"}}
    assert validate.commit_ranks(good) == good
    bad_cases = [
        ({}, "ranks"),
        ([], "ranks"),
        ({"../../x.0": {"kind": "image"}}, "ranks name"),
        ({"batch.0": {"kind": "image", "epoch": 99}}, "unknown keys"),     # would override op_plan's epoch
        ({"batch.0": {"kind": "exec"}}, "kind"),
        ({"batch.0": {"kind": "completed", "exit_code": NAN}}, "exit_code"),
        ({"batch.0": {"kind": "completed", "exit_code": 10**9}}, "exit_code"),
        ({"batch.0": {"kind": "completed"}}, "exit_code"),
        ({"batch.0": {"kind": "image", "exit_code": 0}}, "exit_code"),
        ({"batch.0": {"kind": "image", "node": "a\x1b]0;pwn\x07"}}, "node"),
        ({"batch.0": "image"}, "ranks"),
    ]
    for value, match in bad_cases:
        with pytest.raises(ProtocolError, match=match):
            validate.commit_ranks(value)


@pytest.mark.parametrize("doc", ['{"wait_s": NaN}', '{"wait_s": Infinity}', '{"x": [-Infinity]}',
                                 "[" * 100_000 + "]" * 100_000, '{"n": ' + "9" * 5000 + "}"])
def test_loads_refuses_nan_infinity_deep_nesting_and_huge_ints(doc):
    with pytest.raises(ValueError):
        validate.loads(doc)


def test_plain_json_loads_accepts_nan_which_is_why_loads_exists():
    assert math.isnan(json.loads('{"wait_s": NaN}')["wait_s"])
    with pytest.raises(RecursionError):
        json.loads("[" * 100_000 + "]" * 100_000)
