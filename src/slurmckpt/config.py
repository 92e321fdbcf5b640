"""Configuration: YAML file -> frozen dataclass. Defaults live here; errors name the key.

Environment overrides `SLURMCKPT_CFG_<KEY>` apply to user-side processes only: the root agent runs with a clean
environment built by the SPANK shim, so a user cannot redirect where root writes images.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from slurmckpt.errors import ConfigError

DEFAULT_PATH = Path("/etc/slurmckpt/slurmckpt.yaml")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A key given twice is an error, not 'the last one wins'."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.YAMLError(f"key '{key}' appears twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _default_criu() -> str:
    return "/usr/local/sbin/criu" if Path("/usr/local/sbin/criu").exists() else "criu"


@dataclass(frozen=True)
class Config:
    storage_root: str = "/var/lib/slurmckpt/images"   # root-owned image store, shared across nodes
    criu_path: str = field(default_factory=_default_criu)
    init_path: str = "/usr/local/libexec/slurmckpt/slurmckpt-init"
    log_dir: str = "/var/log/slurmckpt"
    run_dir: str = "/run/slurmckpt"      # per-task private dirs (the namespace init's cwd)
    freezer_root: str = "auto"            # freezer.default_root(): cgroup v2 where the kernel has it
    keep_epochs: int = 2                 # committed epochs kept per job (restore falls back to the older)
    prepare_timeout_s: float = 30.0      # every rank frozen (and GPUs locked) within this, else ABORT
    capture_timeout_s: float = 600.0     # every rank dumped within this, else ABORT
    walltime_margin_s: float = 45.0      # minimum lead before EndTime for the final capture
    requeue_wait_s: float = 600.0        # how long a finished final capture waits for Slurm's requeue kill
    gpu_lock_timeout_ms: int = 500       # per lock round (see barrier.lock_round)
    gpu_lock_rounds: int = 8
    criu_extra_args: tuple[str, ...] = ()
    # Most bytes of deleted-but-open files one rank's images may hold (criu's --ghost-limit is sized from
    # the tree, ghost.py); a size: bytes or a number with KiB/MiB/GiB.
    ghost_limit_max: int = field(default=256 << 20, metadata={"size": True})
    # Image store and staging (docs/storage.md). Sizes: bytes or a number with KiB/MiB/GiB; 0 = off.
    staging_dir: str = "/var/lib/slurmckpt/staging"    # node-local, root-only: captures dump here first
    staging_max: int = field(default=0, metadata={"size": True})     # all of a node's staging at once
    compression: str = "zstd"            # zstd or off
    compression_level: int = 1           # zstd level 1..19 (1: fastest)
    compression_threads: int = 2         # zstd worker threads of one rank's persist
    persist_nice: int = 10               # nice of a periodic capture's persist (runs beside the job)
    persist_io_class: str = "best-effort"    # its I/O class: best-effort (lowest level) or idle
    persist_timeout_s: float = 1800.0    # a rank's persist (compress + copy to the store) within this
    quota_job: int = field(default=0, metadata={"size": True})       # one job's images in the store
    quota_user: int = field(default=0, metadata={"size": True})      # one user's images, all jobs
    keep_finished: bool = False          # keep a finished job's images (debugging); `slurmckpt gc` skips them
    # Read by proctrack/slurmckpt in each slurmstepd (spank/proctrack_slurmckpt.c), not by Python.
    proctrack_delegate: str = "proctrack/cgroup"
    # Fault injection for tests (like CRIU's CRIU_FAULT): "STAGE:SECONDS" makes every rank's pipeline pause
    # that long after STAGE (e.g. "freeze:8" inside PREPARE, "dump:8" inside CAPTURE). Admin file only.
    debug_stall_after: str = ""

    def __post_init__(self) -> None:
        from slurmckpt.compression import from_settings
        from slurmckpt.persist import IOPRIO_CLASSES
        from_settings(self.compression, self.compression_level, self.compression_threads)
        if not 0 <= self.persist_nice <= 19:
            raise ConfigError(f"key 'persist_nice': bad value {self.persist_nice!r}: want 0..19")
        if self.persist_io_class not in IOPRIO_CLASSES:
            raise ConfigError(f"key 'persist_io_class': bad value {self.persist_io_class!r}: want "
                              f"{' or '.join(IOPRIO_CLASSES)}")
        if not os.path.isabs(self.staging_dir):
            raise ConfigError(f"key 'staging_dir': bad value {self.staging_dir!r}: want an absolute path")

    def codec(self):
        from slurmckpt.compression import from_settings
        return from_settings(self.compression, self.compression_level, self.compression_threads)

    def stall(self) -> tuple[str, float] | None:
        if not self.debug_stall_after:
            return None
        stage, _, seconds = self.debug_stall_after.partition(":")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if not stage or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"key 'debug_stall_after': bad value {self.debug_stall_after!r}: want STAGE:SECONDS")
        return stage, value

    @classmethod
    def load(cls, path: Path | None = None, environ: dict[str, str] | None = None) -> "Config":
        values: dict[str, object] = {}
        path = path or DEFAULT_PATH
        if path.exists():
            try:
                loaded = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from e
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: expected a mapping of keys to values")
            values.update(loaded)
        for key in (environ or {}):
            if key.startswith("SLURMCKPT_CFG_"):
                values[key[len("SLURMCKPT_CFG_"):].lower()] = environ[key]  # type: ignore[index]
        return cls.from_mapping(values, source=str(path))

    @classmethod
    def from_mapping(cls, values: dict[str, object], source: str = "config") -> "Config":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, object] = {}
        for key, raw in values.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
            if fields[key].metadata.get("size"):
                kwargs[key] = _coerce(key, parse_size(key, raw, source), "int", source)
            else:
                kwargs[key] = _coerce(key, raw, fields[key].type, source)
        return cls(**kwargs)  # type: ignore[arg-type]


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(key: str, raw: object, source: str = "config") -> int:
    """A byte count: an integer, or a number with a unit (KiB, MiB, GiB; K/M/G mean the same)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(raw))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{source}: key '{key}': bad value {raw!r}: want bytes or a number with KiB, MiB "
                          "or GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _coerce(key: str, raw: object, typ: object, source: str) -> object:
    try:
        if typ in ("bool", bool):
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("true", "yes", "on", "1"):
                return True
            if str(raw).lower() in ("false", "no", "off", "0"):
                return False
            raise ValueError("want true or false")
        if typ in ("int", int):
            value: object = int(raw)  # type: ignore[arg-type]
            if value < 0:  # type: ignore[operator]
                raise ValueError("must be >= 0")
            return value
        if typ in ("float", float):
            value = float(raw)  # type: ignore[arg-type]
            if not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
                raise ValueError("must be a finite number > 0")
            return value
        if str(typ).startswith("tuple"):
            if isinstance(raw, str):
                return tuple(raw.split())
            return tuple(str(x) for x in raw)  # type: ignore[union-attr]
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        return raw
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: key '{key}': bad value {raw!r}: {e}") from e


def load_user_config() -> Config:
    return Config.load(environ=dict(os.environ))
