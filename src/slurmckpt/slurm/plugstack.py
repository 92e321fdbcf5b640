"""The SPANK plugin chain as Slurm reads it (src/common/plugstack.c of Slurm 22.05): slurm.conf's
`PlugStackConfig` (default: plugstack.conf next to slurm.conf; slurm.conf's own `Include` lines followed),
then every `required`/`optional` line and every `include GLOB` (relative to the including file's directory,
matches in sorted order, none is no error) of plugstack.conf. A plugin path that is not absolute is looked up
in slurm.conf's `PluginDir` entries. `#` starts a comment anywhere on a line.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from slurmckpt.config import DEFAULT_SLURM_CONF
from slurmckpt.duration import parse_interval

PLUGIN_NAME = "slurmckpt_spank.so"
MAX_DEPTH = 16            # includes deeper than this are a loop


@dataclass(frozen=True)
class PlugLine:
    file: str
    line: int
    kind: str              # required | optional
    path: str              # as written
    resolved: str | None   # the file Slurm would load (None: not found)
    args: tuple[str, ...]

    def arg(self, key: str) -> str | None:
        """The value of `key=` among the plugin's arguments."""
        return next((a.split("=", 1)[1] for a in self.args if a.startswith(key + "=")), None)


@dataclass
class Chain:
    slurm_conf: str
    plugstack: str
    lines: list[PlugLine] = field(default_factory=list)
    files: list[str] = field(default_factory=list)       # every file read, in order
    problems: list[str] = field(default_factory=list)    # what Slurm would log or fail on

    def slurmckpt(self) -> PlugLine | None:
        return next((l for l in self.lines if os.path.basename(l.path) == PLUGIN_NAME), None)

    def default_interval(self) -> int:
        """Seconds of the plugin's default_interval=, or duration.AUTO (0: off, also when the plugin is not configured or the
        value is not one the shim accepts: then the shim refuses to load and no job is wrapped by default)."""
        line = self.slurmckpt()
        value = line.arg("default_interval") if line else None
        try:
            return parse_interval(value) if value else 0
        except ValueError:
            return 0


def slurm_conf_path(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("SLURM_CONF") or DEFAULT_SLURM_CONF


def slurm_conf_values(path: str, keys: tuple[str, ...], depth: int = 0) -> dict[str, str]:
    """The last value of each of `keys` (case-insensitive, as Slurm reads them) in slurm.conf and the files
    it includes."""
    wanted = {k.lower(): k for k in keys}
    found: dict[str, str] = {}
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return found
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        if word.lower() == "include" and depth < MAX_DEPTH:
            target = rest.strip() if rest.strip().startswith("/") else os.path.join(os.path.dirname(path), rest.strip())
            for inc in sorted(glob.glob(target)):
                found.update(slurm_conf_values(inc, keys, depth + 1))
            continue
        key, eq, value = line.partition("=")
        if eq and key.strip().lower() in wanted:
            found[wanted[key.strip().lower()]] = value.strip()
    return found


def read_chain(slurm_conf: str | None = None) -> Chain:
    slurm_conf = slurm_conf or slurm_conf_path()
    conf = slurm_conf_values(slurm_conf, ("PlugStackConfig", "PluginDir"))
    plugstack = conf.get("PlugStackConfig") or os.path.join(os.path.dirname(slurm_conf), "plugstack.conf")
    chain = Chain(slurm_conf, plugstack)
    if not Path(slurm_conf).exists():
        chain.problems.append(f"{slurm_conf} does not exist")
    plugin_dirs = [d for d in conf.get("PluginDir", "").split(":") if d]
    if not Path(plugstack).exists():
        chain.problems.append(f"{plugstack} (PlugStackConfig) does not exist: Slurm loads no SPANK plugin")
        return chain
    _read_plugstack(chain, plugstack, plugin_dirs, 0)
    return chain


def _read_plugstack(chain: Chain, path: str, plugin_dirs: list[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        chain.problems.append(f"{path}: includes nested deeper than {MAX_DEPTH} (a loop?)")
        return
    chain.files.append(path)
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        chain.problems.append(f"{path}: {e.strerror}")
        return
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        kind, rest = words[0], words[1:]
        if kind == "include":
            if not rest:
                chain.problems.append(f"{path}:{number}: include without a pattern")
                continue
            pattern = rest[0] if rest[0].startswith("/") else os.path.join(os.path.dirname(path), rest[0])
            for inc in sorted(glob.glob(pattern)):
                _read_plugstack(chain, inc, plugin_dirs, depth + 1)
        elif kind in ("required", "optional") and rest:
            chain.lines.append(PlugLine(path, number, kind, rest[0], _resolve(rest[0], plugin_dirs),
                                        tuple(rest[1:])))
        else:
            chain.problems.append(f"{path}:{number}: not 'required PATH', 'optional PATH' or 'include GLOB': "
                                  f"{raw.strip()!r}")


def _resolve(plugin: str, plugin_dirs: list[str]) -> str | None:
    if plugin.startswith("/"):
        return plugin if os.path.isfile(plugin) else None
    return next((os.path.join(d, plugin) for d in plugin_dirs if os.path.isfile(os.path.join(d, plugin))), None)
