"""Checks for every value that crosses from the user side into slurmckpt's decisions: the wrapper's requests to
its root agent (agent.py) and the ranks' messages to the coordinator (coordinator/). The job's user controls
those bytes, so every number is finite and bounded, every name matches the one shape it can have, and a value
that does not fits nowhere: ProtocolError naming the field, before it touches a path, a sleep or a loop.

JSON parsing goes through `loads`/`DECODER`: NaN and +-Infinity, which Python's json accepts by default, are
refused at parse time, and so is nesting too deep to decode (RecursionError) or an integer too long to convert.
"""
from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Any

from slurmckpt.errors import ProtocolError
from slurmckpt.identity import RankName

MAX_EPOCH = 10**6 - 1              # epoch-NNNNNN
MAX_TASKS = 100_000                # tasks of one step (Slurm's own limits are far lower per node)
MAX_STEP = 2**32 - 256             # Slurm's special step ids (batch, extern, ...) sit above this
MAX_WAIT_S = 120.0
MAX_INTERVAL_S = 366 * 24 * 3600
MAX_RANKS_PER_COMMIT = MAX_TASKS * 4
MAX_TEXT = 64 * 1024              # free text (an error message, a criu log tail): stored cut, shown escaped
RECORD_KINDS = ("image", "replay", "completed")

_STEP = re.compile(r"batch|0|[1-9][0-9]{0,9}")
_INDEX = re.compile(r"0|[1-9][0-9]{0,5}")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}")        # a trigger reason, an action
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,253})")      # a node name as Slurm spells it
_TOKEN = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[0-9a-f]{32}")
TOKEN_HEX16 = re.compile(r"[0-9a-f]{16}")      # a relayed srun's step token (srun_relay.py)


def _refuse(field: str, value: object, why: str) -> ProtocolError:
    shown = repr(value)
    return ProtocolError(f"bad {field} {shown[:80]}{'...' if len(shown) > 80 else ''}: {why}")


# ---- parsing -------------------------------------------------------------------------------------------------
def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


DECODER = json.JSONDecoder(parse_constant=_no_constant)


def loads(text: str | bytes) -> object:
    """json.loads without NaN/Infinity; any malformed input is a ValueError (never RecursionError)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError as e:
        raise ValueError("nested too deeply") from e


# ---- scalars ---------------------------------------------------------------------------------------------------
def integer(value: object, field: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refuse(field, value, "not an integer")
    if not lo <= value <= hi:
        raise _refuse(field, value, f"not in {lo}..{hi}")
    return value


def number(value: object, field: str, lo: float, hi: float) -> float:
    """A finite int or float in [lo, hi] (NaN compares false with everything, so it is checked first)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _refuse(field, value, "not a number")
    if not math.isfinite(value):
        raise _refuse(field, value, "not finite")
    if not lo <= value <= hi:
        raise _refuse(field, value, f"not in {lo}..{hi}")
    return float(value)


def flag(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise _refuse(field, value, "not true/false")
    return value


def text(value: object, field: str, limit: int = MAX_TEXT) -> str:
    """Free text (an error message): a string, bounded; shown escaped by whoever prints it."""
    if not isinstance(value, str):
        raise _refuse(field, value, "not a string")
    if len(value) > limit:
        raise _refuse(field, value, f"longer than {limit} characters")
    return value


def _match(pattern: re.Pattern[str], value: object, field: str, what: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise _refuse(field, value, f"not {what}")
    return value


def label(value: object, field: str) -> str:
    return _match(_LABEL, value, field, "a short name ([A-Za-z0-9_.:+-], at most 64)")


def hostname(value: object, field: str = "node") -> str:
    return _match(_HOST, value, field, "a host name")


def token(value: object, field: str = "token") -> str:
    return _match(_TOKEN, value, field, "64 hex digits")


def nonce(value: object, field: str = "nonce") -> str:
    return _match(_NONCE, value, field, "32 hex digits")


def ip_address(value: object, field: str = "host") -> str:
    """A unicast IP address literal (where ranks connect: no name to resolve, no wildcard, no scope)."""
    if isinstance(value, str) and len(value) <= 64 and "%" not in value:
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            pass
        else:
            if not (address.is_unspecified or address.is_multicast):
                return str(address)
    raise _refuse(field, value, "not a unicast IP address")


def port(value: object, field: str = "port") -> int:
    return integer(value, field, 1, 65535)


def epoch(value: object, field: str = "epoch") -> int:
    return integer(value, field, 1, MAX_EPOCH)


def wait_s(value: object, field: str = "wait_s") -> float:
    return number(value, field, 0.0, MAX_WAIT_S)


# ---- job names ---------------------------------------------------------------------------------------------------
def step(value: object, field: str = "step") -> str:
    _match(_STEP, value, field, "a step id (batch or digits)")
    if value != "batch" and int(str(value)) > MAX_STEP:
        raise _refuse(field, value, f"above {MAX_STEP}")
    return str(value)


def rank_index(value: object, field: str = "rank") -> int:
    return integer(value, field, 0, MAX_TASKS - 1)


def rank_name(value: object, field: str = "rank") -> RankName:
    """`<step>.<rank>` -> RankName, the one reading of a rank's name: step `batch` or digits, rank digits, both bounded, no leading zeros
    (one spelling per rank: `0.01` and `0.1` must not be two directories)."""
    if not isinstance(value, str) or len(value) > 32:
        raise _refuse(field, value, "not <step>.<rank>")
    s, dot, r = value.partition(".")
    if not dot or _STEP.fullmatch(s) is None or _INDEX.fullmatch(r) is None:
        raise _refuse(field, value, "not <step>.<rank> (step batch or digits, rank digits)")
    step(s, field)
    return RankName(s, rank_index(int(r), field))


def scope(value: object, field: str = "scope") -> str:
    """Whose coordinator: the job's, or a stand-alone step's (by its step id)."""
    if value == "job":
        return "job"
    if value == "batch":
        raise _refuse(field, value, "the batch step's coordinator is the job's")
    return step(value, field)


def record(name: str, value: object) -> dict[str, Any]:
    """One rank's entry of a commit: what the coordinator builds (kind, node, exit code), nothing else."""
    where = f"ranks[{name}]"
    if not isinstance(value, dict):
        raise _refuse(where, value, "not an object")
    extra = set(value) - {"kind", "node", "exit_code"}
    if extra:
        raise _refuse(where, sorted(extra), "unknown keys")
    if value.get("kind") not in RECORD_KINDS:
        raise _refuse(f"{where}.kind", value.get("kind"), f"not one of {', '.join(RECORD_KINDS)}")
    out = {"kind": value["kind"]}
    if "node" in value:
        out["node"] = hostname(value["node"], f"{where}.node")
    if value["kind"] == "completed":
        out["exit_code"] = integer(value.get("exit_code"), f"{where}.exit_code", -255, 255)
    elif "exit_code" in value:
        raise _refuse(f"{where}.exit_code", value["exit_code"], "only a completed rank has one")
    return out


def commit_ranks(value: object, field: str = "ranks") -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict):
        raise _refuse(field, value, "not {name: record}")
    if not 0 < len(value) <= MAX_RANKS_PER_COMMIT:
        raise _refuse(field, len(value), f"not 1..{MAX_RANKS_PER_COMMIT} ranks")
    out = {}
    for name, rec in value.items():
        rank_name(name, f"{field} name")
        out[name] = record(name, rec)
    return out


def launch(m: dict[str, Any], nfds: int) -> tuple[list[str], dict[str, str], str, bool]:
    """A wrapper's launch request: (argv, env, cwd, allow_io_uring), each checked, with its 3 stdio fds."""
    argv, env, cwd = m.get("argv"), m.get("env"), m.get("cwd")
    allow_io_uring = m.get("allow_io_uring", False)
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
            and isinstance(env, dict) and isinstance(cwd, str) and nfds == 3
            and isinstance(allow_io_uring, bool)):
        raise ProtocolError("launch needs argv (list of str), env (dict), cwd, 3 stdio fds and, if any, "
                            "allow_io_uring (bool)")
    env = {str(k): str(v) for k, v in env.items()}
    if any("\0" in a for a in [*argv, *env, *env.values(), cwd]) or any("=" in k or not k for k in env):
        raise ProtocolError("launch: NUL in argv/env/cwd, or an env name that is empty or holds '='")
    return argv, env, cwd, allow_io_uring
