"""The node's packet filter, the one place that changes it: rules that drop a TCP connection's packets while
only one end of it is restored (netlock.py for two ranks on one node, crossnode.py between nodes), and the
network lock criu itself takes around a dump and a restore.

iptables where the node has it; nftables where it has not (GPU node images often lack iptables: criu's own
lock then failed with "iptables: not found" for every tree with a TCP connection). Config `network_lock`:
auto (the default: iptables if `iptables-restore` is installed, else nftables), iptables or nftables. The
nftables rules go through libnftables (which our criu links too), so no `nft` binary is needed.

Each job has one rule set per node, named by the job (docs/architecture.md, "The node's packet filter"):
- iptables: a chain `SLURMCKPT-<job>` per IP version, entered from OUTPUT by one jump; each rule carries
  the comment "slurmckpt job <job>";
- nftables: a table `inet slurmckpt-<job>` whose one chain on the output hook drops what its two sets (v4,
  v6: address . port . address . port) hold: one base chain per job, never one per connection (a network
  namespace takes 1024 base chains on a hook, and criu's own lock needs two for every dump and restore).
A change of the set (`update`) is one batch whatever the number of connections (one `iptables-restore` per
IP version, one nftables transaction) after one look at what the job holds; it refuses to hold more than
the job's cap; the set goes whole with its last rule, and `update(..., everything)` (job end, gc) takes all
of it. The caller serialises the changes of one job (rendezvous.job_lock). Every rule lets criu's repair
traffic through (packets marked 0xC114, as criu's own rules do).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import json
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from slurmckpt.errors import RestoreError

SOCCR_MARK = "0xC114"
PATH = "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
CHAIN = "SLURMCKPT-"          # iptables: SLURMCKPT-<job>
TABLE = "slurmckpt-"          # nftables: inet slurmckpt-<job>
NFT_JSON = 1 << 4             # libnftables' NFT_CTX_OUTPUT_JSON


class CommandFailed(OSError):
    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


Runner = Callable[[list[str], str], str]      # (command, stdin text) -> stdout; CommandFailed on failure


def tag(job: int) -> str:
    """What every rule of the job says it is."""
    return f"slurmckpt job {int(job)}"


@dataclass(frozen=True, order=True)
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
    def from_list(cls, item: Iterable[Any]) -> Drop:
        src, sport, dst, dport = item
        return cls(str(ipaddress.ip_address(src)), int(sport), str(ipaddress.ip_address(dst)), int(dport))


@dataclass(frozen=True)
class Held:
    """A job's rule set on this node as the filter holds it now: its rules, and which containers exist
    (iptables: the IP versions with a chain; nftables: {0} when the table exists)."""
    drops: frozenset[Drop] = frozenset()
    present: frozenset[int] = frozenset()


class PacketFilter(Protocol):
    name: str
    def held(self, job: int) -> Held: ...
    def apply(self, job: int, now: Held, after: frozenset[Drop]) -> None: ...
    def jobs(self) -> set[int]: ...


def update(packets: PacketFilter, job: int, add: Iterable[Drop] = (), remove: Iterable[Drop] = (),
           cap: int | None = None) -> int:
    """Hold `add` and lift `remove` (rules already gone are no error) in the job's set, in one batch; the
    rules the job holds afterwards. `cap`: most connections the job may hold on this node (a connection
    between two ranks here takes two rules, one to another node one): above 2 x cap nothing is changed and
    the restore is refused. The caller holds the job's lock (rendezvous.job_lock)."""
    now = packets.held(job)
    adding = frozenset(add)
    after = (now.drops | adding) - frozenset(remove)
    if cap is not None and adding - now.drops and len(after) > 2 * cap:
        raise RestoreError(f"this restore would hold {len(after)} TCP rules for the job on this node, above "
                           f"2 x tcp_hold_max ({cap} connections): not held, the restore is refused "
                           "(docs/mpi.md, \"TCP inside the job\")", job=job)
    if after != now.drops or (not after and now.present):
        packets.apply(job, now, after)
    return len(after)


def lift_job(packets: PacketFilter, job: int) -> int:
    """Every rule of the job on this node; how many there were."""
    now = packets.held(job)
    if now.drops or now.present:
        packets.apply(job, now, frozenset())
    return len(now.drops)


def _run(cmd: list[str], stdin: str) -> str:
    try:
        p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env={"PATH": PATH}, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CommandFailed(f"{cmd[0]}: {e}", 127) from e
    if p.returncode != 0:
        raise CommandFailed(f"{cmd[0]} failed ({p.returncode}): {p.stderr.strip()[:500]}", p.returncode)
    return p.stdout


_RULE_RE = re.compile(r"^-A (?P<chain>\S+) -s (?P<src>\S+?)(?:/\d+)? -d (?P<dst>\S+?)(?:/\d+)? -p tcp "
                      r"-m tcp --sport (?P<sport>\d+) --dport (?P<dport>\d+) ")


class Iptables:
    """A chain per job and IP version, changed by one `iptables-restore --noflush` batch."""
    name = "iptables"

    def __init__(self, runner: Runner = _run) -> None:
        self.runner = runner

    @staticmethod
    def chain(job: int) -> str:
        return f"{CHAIN}{int(job)}"

    @staticmethod
    def spec(d: Drop, job: int) -> str:
        return (f"-p tcp -s {d.src} --sport {d.sport} -d {d.dst} --dport {d.dport} -m mark ! --mark "
                f'{SOCCR_MARK} -m comment --comment "{tag(job)}" -j DROP')

    @classmethod
    def jump(cls, job: int) -> str:
        return f'-p tcp -m comment --comment "{tag(job)}" -j {cls.chain(job)}'

    @staticmethod
    def _tools(version: int) -> tuple[str, str]:
        return ("iptables", "iptables-restore") if version == 4 else ("ip6tables", "ip6tables-restore")

    def held(self, job: int) -> Held:
        drops: set[Drop] = set()
        present = set()
        for version in (4, 6):
            try:
                text = self.runner([self._tools(version)[0], "-w", "-S", self.chain(job)], "")
            except CommandFailed as e:
                if e.returncode in (1, 127):      # no such chain (or no ip6tables at all)
                    continue
                raise
            present.add(version)
            for line in text.splitlines():
                m = _RULE_RE.match(line)
                if m and m["chain"] == self.chain(job):
                    drops.add(Drop.from_list([m["src"], m["sport"], m["dst"], m["dport"]]))
        return Held(frozenset(drops), frozenset(present))

    def apply(self, job: int, now: Held, after: frozenset[Drop]) -> None:
        chain = self.chain(job)
        for version in (4, 6):
            want = {d for d in after if d.version == version}
            have = {d for d in now.drops if d.version == version}
            if want and version not in now.present:
                lines = [f"-N {chain}", *(f"-A {chain} {self.spec(d, job)}" for d in sorted(want)),
                         f"-I OUTPUT {self.jump(job)}"]
            elif want:
                lines = [*(f"-D {chain} {self.spec(d, job)}" for d in sorted(have - want)),
                         *(f"-A {chain} {self.spec(d, job)}" for d in sorted(want - have))]
            elif version in now.present:
                lines = [f"-D OUTPUT {self.jump(job)}", f"-F {chain}", f"-X {chain}"]
            else:
                lines = []
            if not lines:
                continue
            try:
                self._restore(version, lines)
            except CommandFailed:
                if lines[0] != f"-D OUTPUT {self.jump(job)}":
                    raise
                self._restore(version, lines[1:])     # its jump was removed by hand: the chain still goes

    def _restore(self, version: int, lines: list[str]) -> None:
        self.runner([self._tools(version)[1], "-w", "--noflush"], "*filter\n" + "\n".join(lines) + "\nCOMMIT\n")

    def jobs(self) -> set[int]:
        found = set()
        for version in (4, 6):
            try:
                text = self.runner([self._tools(version)[0], "-w", "-S"], "")
            except CommandFailed as e:
                if e.returncode == 127:
                    continue
                raise
            found |= {int(m) for m in re.findall(rf"^-N {CHAIN}(\d+)$", text, re.M)}
        return found


class Nftables:
    """A table per job in which one output chain drops what its two sets hold, changed in one transaction
    through libnftables."""
    name = "nftables"
    SETS = {4: ("v4", "ip", "ipv4_addr"), 6: ("v6", "ip6", "ipv6_addr")}

    def __init__(self, execute: Callable[[str, int], str] | None = None) -> None:
        self.execute = execute or libnftables_run

    @staticmethod
    def table(job: int) -> str:
        return f"inet {TABLE}{int(job)}"

    @staticmethod
    def element(d: Drop) -> str:
        return f"{d.src} . {d.sport} . {d.dst} . {d.dport}"

    def held(self, job: int) -> Held:
        try:
            text = self.execute(f"list table {self.table(job)}\n", NFT_JSON)
        except OSError as e:
            if "No such file or directory" in str(e):
                return Held()
            raise
        drops = set()
        for item in json.loads(text or "{}").get("nftables", []):
            for elem in item.get("set", {}).get("elem", []) if isinstance(item, dict) else []:
                value = elem.get("elem", {}).get("val", elem) if isinstance(elem, dict) else elem
                parts = value.get("concat") if isinstance(value, dict) else None
                if isinstance(parts, list) and len(parts) == 4:
                    drops.add(Drop.from_list(parts))
        return Held(frozenset(drops), frozenset({0}))

    def apply(self, job: int, now: Held, after: frozenset[Drop]) -> None:
        t = self.table(job)
        if not after:
            self.execute(f"add table {t}\ndelete table {t}\n", 0)       # gone, whether it was there or not
            return
        lines = [f"add table {t}"]
        for name, ip, kind in self.SETS.values():
            lines.append(f"add set {t} {name} {{ type {kind} . inet_service . {kind} . inet_service ; }}")
        lines += [f"add chain {t} hold {{ type filter hook output priority -10 ; policy accept ; }}",
                  f"flush chain {t} hold"]
        lines += [f"add rule {t} hold meta mark != {SOCCR_MARK.lower()} {ip} saddr . tcp sport . {ip} daddr "
                  f". tcp dport @{name} counter drop comment {json.dumps(tag(job))}"
                  for name, ip, _ in self.SETS.values()]
        for version, (name, _, _) in self.SETS.items():
            new = sorted(d for d in after - now.drops if d.version == version)
            gone = sorted(d for d in now.drops - after if d.version == version)
            if new:
                lines.append(f"add element {t} {name} {{ {', '.join(map(self.element, new))} }}")
            if gone:     # added first, so that one already gone is no error
                elements = ", ".join(map(self.element, gone))
                lines += [f"add element {t} {name} {{ {elements} }}", f"delete element {t} {name} {{ {elements} }}"]
        self.execute("\n".join(lines) + "\n", 0)

    def jobs(self) -> set[int]:
        text = self.execute("list tables\n", 0)
        return {int(m) for m in re.findall(rf"^table inet {TABLE}(\d+)$", text, re.M)}


def libnftables_run(script: str, flags: int = 0) -> str:
    """Run an nft script in this process's network namespace (atomically: all or nothing); its output."""
    lib = _libnftables()
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        raise OSError("nft_ctx_new failed")
    try:
        lib.nft_ctx_buffer_error(ctx)
        lib.nft_ctx_buffer_output(ctx)          # never onto this process's stdout (the agent's is slurmd's log)
        if flags:
            lib.nft_ctx_output_set_flags(ctx, flags)
        if lib.nft_run_cmd_from_buffer(ctx, script.encode()) != 0:
            err = lib.nft_ctx_get_error_buffer(ctx)
            raise OSError(f"nftables: {(err or b'').decode(errors='replace').strip()[:500]}")
        return (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
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
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
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


def installed() -> list[PacketFilter]:
    """Every packet filter this node has: a job's end lifts its rules from each (the site may have changed
    `network_lock` since they were made)."""
    return [f for f, present in ((Iptables(), has_iptables()), (Nftables(), has_libnftables())) if present]
