"""Stand-ins for the node's packet filters (packet_filter.py) that keep state as the real ones do: iptables'
filter table per IP version (chains, rules, `-S` as iptables prints it, a restore batch all or nothing) and
nftables' tables (sets, base chains, `list` as JSON, a transaction all or nothing). Each counts its calls,
so that a test can say how many a hold took. The real tools are tested in a network namespace of their own
(tests/integration/test_network_lock.py)."""
from __future__ import annotations

import copy
import json
import re

from slurmckpt.node.packet_filter import CommandFailed, Iptables, Nftables

RULE = re.compile(r"-p tcp -s (\S+) --sport (\d+) -d (\S+) --dport (\d+) (.*)$")


class FakeIptables:
    """`iptables -S`, `iptables-restore --noflush` of both IP versions."""

    def __init__(self) -> None:
        self.chains: dict[int, dict[str, list[str]]] = {4: {"OUTPUT": []}, 6: {"OUTPUT": []}}
        self.calls: list[list[str]] = []

    def filter(self) -> Iptables:
        return Iptables(self)

    def __call__(self, cmd: list[str], stdin: str) -> str:
        self.calls.append(cmd)
        version = 6 if cmd[0].startswith("ip6") else 4
        if cmd[0].endswith("-restore"):
            table = copy.deepcopy(self.chains[version])
            for line in stdin.splitlines():
                if line not in ("*filter", "COMMIT"):
                    self._command(table, line)
            self.chains[version] = table
            return ""
        chains = self.chains[version]
        if len(cmd) > 3:
            if cmd[3] not in chains:
                raise CommandFailed(f"chain `{cmd[3]}' in table `filter' is incompatible", 1)
            names = [cmd[3]]
        else:
            names = list(chains)
        out = []
        for name in names:
            out.append(f"-P {name} ACCEPT" if name == "OUTPUT" else f"-N {name}")
            out += [f"-A {name} {self._saved(rule)}" for rule in chains[name]]
        return "\n".join(out) + "\n"

    @staticmethod
    def _saved(rule: str) -> str:
        """A rule as `iptables -S` prints it (addresses with their prefix length, `-m tcp`)."""
        m = RULE.match(rule)
        if not m:
            return rule
        src, sport, dst, dport, rest = m.groups()
        bits = "/128" if ":" in src else "/32"
        return f"-s {src}{bits} -d {dst}{bits} -p tcp -m tcp --sport {sport} --dport {dport} {rest}"

    @staticmethod
    def _command(table: dict[str, list[str]], line: str) -> None:
        op, chain, *rest = line.split(" ", 2)
        rule = rest[0] if rest else ""
        if op == "-N":
            if chain in table:
                raise CommandFailed("Chain already exists", 1)
            table[chain] = []
        elif op in ("-A", "-I", "-D", "-F", "-X") and chain not in table:
            raise CommandFailed(f"No chain/target/match by that name: {chain}", 1)
        elif op == "-A":
            table[chain].append(rule)
        elif op == "-I":
            table[chain].insert(0, rule)
        elif op == "-D":
            if rule not in table[chain]:
                raise CommandFailed("Bad rule (does a matching rule exist in that chain?)", 1)
            table[chain].remove(rule)
        elif op == "-F":
            table[chain].clear()
        elif op == "-X":
            if table[chain] or any(r.endswith(f"-j {chain}") for rules in table.values() for r in rules):
                raise CommandFailed("Directory not empty / Too many links", 1)
            del table[chain]

    def rules(self, job: int | None = None) -> list[str]:
        """Every rule of both versions (of `job`'s chain and its jump only, if given)."""
        name = Iptables.chain(job) if job is not None else None
        return [r for v in (4, 6) for chain, rules in self.chains[v].items() for r in rules
                if name is None or chain == name or r.endswith(f"-j {name}")]

    def job_chains(self) -> list[str]:
        return sorted(c for v in (4, 6) for c in self.chains[v] if c != "OUTPUT")


ELEMENTS = re.compile(r"^(add|delete) element inet (\S+) (v4|v6) \{ (.*) \}$")


def _concat(element: str) -> list[object]:
    """`a . 1 . b . 2` as nftables' JSON lists it: ["a", 1, "b", 2]."""
    src, sport, dst, dport = element.split(" . ")
    return [src, int(sport), dst, int(dport)]


class FakeNftables:
    """libnftables_run: the scripts of packet_filter.Nftables, one transaction each."""

    def __init__(self, max_base_chains: int = 1024) -> None:
        self.tables: dict[str, dict[str, object]] = {}
        self.calls: list[str] = []
        self.max_base_chains = max_base_chains

    def filter(self) -> Nftables:
        return Nftables(self)

    def __call__(self, script: str, flags: int = 0) -> str:
        self.calls.append(script)
        tables = copy.deepcopy(self.tables)
        out = ""
        for line in script.splitlines():
            out += self._command(tables, line, flags)
        if sum(1 for t in tables.values() if t["chain"]) > self.max_base_chains:
            raise OSError("nftables: Error: Could not process rule: Argument list too long")
        self.tables = tables
        return out

    @staticmethod
    def _command(tables: dict[str, dict[str, object]], line: str, flags: int) -> str:
        words = line.split()
        if line.startswith("list tables"):
            return "".join(f"table inet {name}\n" for name in tables)
        name = words[3] if len(words) > 3 else ""
        if words[:2] == ["list", "table"]:
            if name not in tables:
                raise OSError("nftables: Error: No such file or directory")
            t = tables[name]
            sets = [{"set": {"family": "inet", "name": s, "table": name,
                             "elem": [{"concat": _concat(e)} for e in sorted(t[s])]}}     # type: ignore[attr-defined]
                    for s in ("v4", "v6") if t[s]]
            return json.dumps({"nftables": [{"table": {"family": "inet", "name": name}}, *sets]})
        if words[:2] == ["add", "table"]:
            tables.setdefault(name, {"v4": set(), "v6": set(), "chain": False, "rules": 0})
        elif words[:2] == ["delete", "table"]:
            if name not in tables:
                raise OSError("nftables: Error: No such file or directory")
            del tables[name]
        elif words[:2] == ["add", "chain"]:
            tables[name]["chain"] = True
        elif words[:2] == ["flush", "chain"]:
            tables[name]["rules"] = 0
        elif words[:2] == ["add", "rule"]:
            tables[name]["rules"] = int(tables[name]["rules"]) + 1      # type: ignore[call-overload]
        elif (m := ELEMENTS.match(line)):
            verb, name, setname, text = m.groups()
            members = tables[name][setname]
            for element in text.split(", "):
                if verb == "add":
                    members.add(element)                                 # type: ignore[attr-defined]
                elif element not in members:                             # type: ignore[operator]
                    raise OSError("nftables: Error: Could not process rule: No such file or directory")
                else:
                    members.remove(element)                              # type: ignore[attr-defined]
        return ""

    def elements(self, job: int) -> set[str]:
        t = self.tables.get(Nftables.table(job).split()[1])
        return set() if t is None else set(t["v4"]) | set(t["v6"])       # type: ignore[call-overload]
