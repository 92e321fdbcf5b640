"""The node's packet filter, the one place that changes it: rules that drop a TCP connection's packets while
only one end of it is restored (netlock.py for two ranks on one node, crossnode.py between nodes), and the
network lock criu itself takes around a dump and a restore.

iptables where the node has it; nftables where it has not (GPU node images often lack iptables: criu's own
lock then failed with "iptables: not found" for every tree with a TCP connection). Config `network_lock`:
auto (the default: iptables if `iptables-restore` is installed, else nftables), iptables or nftables. The
nftables rules go through libnftables (which our criu links too), so no `nft` binary is needed: each hold
is a chain of its own in table `inet slurmckpt`, named from its rules, and lifting it deletes that chain.

Every rule lets criu's repair traffic through (packets marked 0xC114, as criu's own rules do).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import ipaddress
import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Protocol

SOCCR_MARK = "0xC114"
PATH = "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
TABLE = "slurmckpt"
Runner = Callable[[list[str], str], None]      # (command, stdin text): raises OSError on failure


@dataclass(frozen=True)
class Drop:
    """Outgoing TCP packets from src:sport to dst:dport, dropped (never answered by a RST)."""
    src: str
    sport: int
    dst: str
    dport: int

    @property
    def version(self) -> int:
        return ipaddress.ip_address(self.src).version

    def to_list(self) -> list[Any]:
        return [self.src, self.sport, self.dst, self.dport]

    @classmethod
    def from_list(cls, item: list[Any]) -> Drop:
        src, sport, dst, dport = item
        return cls(str(ipaddress.ip_address(src)), int(sport), str(ipaddress.ip_address(dst)), int(dport))


class PacketFilter(Protocol):
    name: str
    def hold(self, drops: list[Drop], tag: str) -> None: ...
    def lift(self, drops: list[Drop], tag: str) -> None: ...


def _run(cmd: list[str], stdin: str) -> None:
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env={"PATH": PATH}, timeout=120)
    if p.returncode != 0:
        raise OSError(f"{cmd[0]} failed ({p.returncode}): {p.stderr.strip()[:500]}")


class Iptables:
    """iptables-restore --noflush batches, one per IP version."""
    name = "iptables"

    def __init__(self, runner: Runner = _run) -> None:
        self.runner = runner

    @staticmethod
    def spec(d: Drop, tag: str) -> str:
        return (f"OUTPUT -p tcp -s {d.src} --sport {d.sport} -d {d.dst} --dport {d.dport} -m mark ! --mark "
                f'{SOCCR_MARK} -m comment --comment "{tag}" -j DROP')

    def _batch(self, verb: str, drops: list[Drop], tag: str) -> None:
        for version in (4, 6):
            specs = [self.spec(d, tag) for d in drops if d.version == version]
            if specs:
                text = "*filter\n" + "".join(f"{verb} {s}\n" for s in specs) + "COMMIT\n"
                self.runner(["iptables-restore" if version == 4 else "ip6tables-restore", "-w", "--noflush"], text)

    def hold(self, drops: list[Drop], tag: str) -> None:
        self._batch("-I", drops, tag)

    def lift(self, drops: list[Drop], tag: str) -> None:
        try:
            self._batch("-D", drops, tag)
        except OSError:             # one rule already gone fails the batch: delete them one by one
            failed = None
            for d in drops:
                try:
                    self._batch("-D", [d], tag)
                except OSError as e:
                    failed = e
            if failed and len(drops) == 1:
                raise failed


class Nftables:
    """One base chain per hold in table inet slurmckpt, through libnftables."""
    name = "nftables"

    def __init__(self, execute: Callable[[str], None] | None = None) -> None:
        self.execute = execute or libnftables_run

    @staticmethod
    def chain(drops: list[Drop], tag: str) -> str:
        key = json.dumps([sorted(d.to_list() for d in drops), tag], sort_keys=True)
        return "hold-" + hashlib.sha256(key.encode()).hexdigest()[:24]

    @staticmethod
    def rule(d: Drop, tag: str) -> str:
        ip = "ip" if d.version == 4 else "ip6"
        return (f"{ip} saddr {d.src} tcp sport {d.sport} {ip} daddr {d.dst} tcp dport {d.dport} "
                f"meta mark != {SOCCR_MARK.lower()} counter drop comment {json.dumps(tag[:120])}")

    def hold(self, drops: list[Drop], tag: str) -> None:
        name = self.chain(drops, tag)
        lines = [f"add table inet {TABLE}",
                 f"add chain inet {TABLE} {name} {{ type filter hook output priority -10 ; policy accept ; }}",
                 f"flush chain inet {TABLE} {name}"]
        lines += [f"add rule inet {TABLE} {name} {self.rule(d, tag)}" for d in drops]
        self.execute("\n".join(lines) + "\n")

    def lift(self, drops: list[Drop], tag: str) -> None:
        name = self.chain(drops, tag)
        self.execute(f"flush chain inet {TABLE} {name}\ndelete chain inet {TABLE} {name}\n")


def libnftables_run(script: str) -> None:
    """Run an nft script in this process's network namespace (atomically: all or nothing)."""
    lib = _libnftables()
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        raise OSError("nft_ctx_new failed")
    try:
        lib.nft_ctx_buffer_error(ctx)
        lib.nft_ctx_buffer_output(ctx)          # never onto this process's stdout (the agent's is slurmd's log)
        if lib.nft_run_cmd_from_buffer(ctx, script.encode()) != 0:
            err = lib.nft_ctx_get_error_buffer(ctx)
            raise OSError(f"nftables: {(err or b'').decode(errors='replace').strip()[:500]}")
    finally:
        lib.nft_ctx_free(ctx)


def _libnftables() -> ctypes.CDLL:
    name = ctypes.util.find_library("nftables") or "libnftables.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        raise OSError(f"libnftables is not installed ({e}): install libnftables1 (criu's nftables lock needs "
                      "it too) or iptables") from e
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    return lib


def has_iptables() -> bool:
    return any(os.access(os.path.join(d, "iptables-restore"), os.X_OK) for d in PATH.split(":"))


def has_libnftables() -> bool:
    try:
        _libnftables()
    except OSError:
        return False
    return True


def method(setting: str = "auto") -> str:
    """"iptables" or "nftables" for config `network_lock` (auto: iptables where installed)."""
    if setting in ("iptables", "nftables"):
        return setting
    return "iptables" if has_iptables() else "nftables"


def for_method(name: str) -> PacketFilter:
    return Iptables() if name == "iptables" else Nftables()
