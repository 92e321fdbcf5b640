"""Configuration: YAML file -> frozen dataclass. Defaults live here; errors name the key.

Where the file is (the first that exists; docs/operations.md, "Configuration"): `$SLURMCKPT_CONFIG` (user-side
tools only), `/etc/slurmckpt/slurmckpt.yaml`, then `slurmckpt.yaml` next to the slurm.conf in use
(`$SLURM_CONF`'s directory, else /etc/slurm). Environment overrides `SLURMCKPT_CFG_<KEY>` apply to user-side
processes only: the root agent runs with a clean environment built by the SPANK shim, so a user cannot
redirect where root writes images.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from slurmckpt.duration import parse_duration
from slurmckpt.errors import ConfigError
from slurmckpt.policy import Policy

DEFAULT_PATH = Path("/etc/slurmckpt/slurmckpt.yaml")
FILE_NAME = "slurmckpt.yaml"
# A persist's I/O priority class (ioprio_set, store/persist.py) and zstd's highest level (store/compression.py):
# checked here, where every key is, so that reading the config loads none of the store's code.
IOPRIO_CLASSES = {"best-effort": 2, "idle": 3}
ZSTD_MAX_LEVEL = 19
DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"


def config_paths(environ: dict[str, str] | None = None) -> list[Path]:
    """Where the config is looked for, in order (the first that exists is read)."""
    env = environ or {}
    paths = [Path(env["SLURMCKPT_CONFIG"])] if env.get("SLURMCKPT_CONFIG") else []
    paths.append(DEFAULT_PATH)
    slurm_dir = Path(env.get("SLURM_CONF") or DEFAULT_SLURM_CONF).parent
    for p in (slurm_dir / FILE_NAME, Path(DEFAULT_SLURM_CONF).parent / FILE_NAME):
        if p not in paths:
            paths.append(p)
    return paths


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types: SafeLoader is Any
    """A key given twice is an error, not 'the last one wins'."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.YAMLError(f"key '{key}' appears twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _default_criu() -> str:
    return "/usr/local/sbin/criu" if Path("/usr/local/sbin/criu").exists() else "criu"


def _key(default: Any = dataclasses.MISSING, doc: str = "", factory: Any = dataclasses.MISSING, **meta: object) -> Any:
    """A config key: its default and the one description slurmckpt.yaml(5) and the docs show (cli/manpage.py)."""
    return field(default=default, default_factory=factory, metadata={"doc": doc, **meta})


def check_compression(name: str, level: int, threads: int) -> None:
    """Keys `compression`, `compression_level`, `compression_threads` (the codec: store/compression.py)."""
    if name in ("off", "none", ""):
        return
    if name != "zstd":
        raise ConfigError(f"key 'compression': bad value {name!r}: want zstd or off")
    if not 1 <= level <= ZSTD_MAX_LEVEL:
        raise ConfigError(f"key 'compression_level': bad value {level!r}: want 1..{ZSTD_MAX_LEVEL}")
    if threads < 1:
        raise ConfigError(f"key 'compression_threads': bad value {threads!r}: want >= 1")


@dataclass(frozen=True)
class Config:
    storage_root: str = _key("/var/lib/slurmckpt/images", "The image store (root-only, 0700): one directory per "
                             "cluster and job. Put it on a file system every node shares, so that a job restores "
                             "on other nodes.")
    criu_path: str = _key(factory=_default_criu, doc="The CRIU binary (>= 4.1). Default: /usr/local/sbin/criu if "
                          "it exists, else criu from PATH.")
    init_path: str = _key("/usr/local/libexec/slurmckpt/slurmckpt-init", "The PID-namespace init of each task's "
                          "tree; the plugstack line's init= overrides it.")
    srun_standin_dir: str = _key("auto", "Directory holding the srun stand-in (the `srun` script that "
                                 "slurmckpt.task.srun_standin.install writes), put first in batch steps' PATH: an MPI launcher's srun then "
                                 "runs outside the checkpointed tree (docs/mpi.md). auto: "
                                 "<python prefix>/libexec/slurmckpt/standin, i.e. /usr/libexec/... for the "
                                 "Debian package, <venv>/libexec/... for a venv install.")
    log_dir: str = _key("/var/log/slurmckpt", "Directory of the agents' log files (root-only, 0700).")
    run_dir: str = _key("/run/slurmckpt", "Node-local directory for per-task private directories and the node's "
                        "metrics state.")
    freezer_root: str = _key("auto", "Where the freeze cgroups go: auto (task_cgroup.default_root(): cgroup v2 "
                             "where the kernel has it) or a cgroup directory.")
    keep_epochs: int = _key(2, "Committed checkpoints kept per job; a restore that fails falls back to the older "
                            "one. The policy may set it per partition or QOS.")
    prepare_timeout_s: float = _key(30.0, "Seconds within which every rank must be frozen (and its GPUs locked), "
                                    "else the epoch aborts and the previous checkpoint stays.")
    capture_timeout_s: float = _key(600.0, "Seconds within which every rank must be dumped, else the epoch aborts.")
    walltime_margin_s: float = _key(45.0, "Least lead before the job's EndTime for its final capture (the margin "
                                    "grows with the last capture's duration).")
    requeue_wait_s: float = _key(600.0, "How long a task whose final capture committed waits for Slurm to take "
                                 "the job down.")
    gpu_lock_timeout_ms: int = _key(500, "Timeout of one GPU lock round, in milliseconds.")
    gpu_lock_rounds: int = _key(8, "Lock rounds tried before an epoch aborts (a GPU lock timed out on work in "
                                   "flight, or a rank was frozen inside a PMI exchange).")
    gpu_growth_defaults: bool = _key(True, "GPU tasks get XLA_PYTHON_CLIENT_PREALLOCATE=false and "
                                     "TF_FORCE_GPU_ALLOW_GROWTH=true unless the job set a memory variable of that "
                                     "framework itself (docs/gpu.md, \"Frameworks that preallocate\").")
    network_lock: str = _key("auto", "How TCP is held while a tree is dumped or restored, by criu and by "
                             "slurmckpt: auto (iptables where `iptables-restore` is installed, else nftables), "
                             "iptables or nftables (through libnftables).", choices=("auto", "iptables", "nftables"))
    nccl_checkpoint_transports: bool = _key(True, "GPU tasks get NCCL settings that keep them checkpointable "
                                            "unless the job set that variable itself: with one GPU of the job on "
                                            "the node NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 "
                                            "(nothing to lose), with several what nccl_multi_gpu says (docs/gpu.md, "
                                            "\"NCCL on a node with several GPUs\"); false: none at all.")
    nccl_multi_gpu: str = _key("sockets", "A job with several GPUs on a node: sockets (NCCL's intra-node "
                               "transports off: checkpointable, collectives between the node's GPUs at about 1/82 "
                               "of NVLink's bandwidth per connection), nvlink (NCCL as without slurmckpt: captures "
                               "are refused while NCCL runs them) or nvlink-ipc (P2P through legacy CUDA IPC in a "
                               "cuda-checkpoint job, driver >= 610 and cuda_checkpoint_launch; else sockets). A job "
                               "chooses with SLURMCKPT_CFG_NCCL_MULTI_GPU; the job's output and `slurmckpt status` "
                               "say which applies.", choices=("sockets", "nvlink", "nvlink-ipc"))
    cuda_checkpoint_launch: str = _key("", "NVIDIA's cuda-checkpoint utility: where the driver is >= 610, GPU "
                                       "tasks start under `cuda-checkpoint --launch-job`, so that the driver "
                                       "checkpoints CUDA IPC between their processes (docs/gpu.md, \"CUDA IPC\"); "
                                       "empty: not used.")
    gpu_capture_memory_raise: bool = _key(False, "Root raises the limit of the job's memory cgroup (Slurm's "
                                          "--mem: memory.max, and memory.high where set) by what a GPU capture "
                                          "adds to it, for the capture, and puts it back after; false: a capture "
                                          "that does not fit under the limit is refused, naming the --mem it "
                                          "needs (docs/gpu.md, \"Host memory of a GPU capture\").")
    torch_store_without_libuv: bool = _key(True, "Every task gets USE_LIBUV=0 unless the job set USE_LIBUV: "
                                           "PyTorch's TCPStore (torch.distributed) then runs without libuv's "
                                           "io_uring, which criu cannot checkpoint (docs/gpu.md).")
    block_io_uring: bool = _key(True, "Every task's tree starts under a seccomp filter that answers io_uring_setup, "
                                "io_uring_enter and io_uring_register with EPERM, unless the job set "
                                "SLURMCKPT_IO_URING=allow: criu cannot checkpoint io_uring, and libraries "
                                "(libuv under PyTorch's TCPStore and torchrun) then go on without one "
                                "(docs/gpu.md, \"io_uring\").")
    criu_extra_args: tuple[str, ...] = _key((), "Extra arguments for every criu dump and restore (a list or one "
                                            "string).")
    ghost_limit_max: int = _key(256 << 20, "Most bytes of deleted-but-open files (e.g. MPI shared memory) one "
                                "rank's images may hold: bytes or a number with KiB, MiB, GiB.", size=True)
    host_copy_threads: int = _key(8, "Threads that copy a GPU checkpoint's host copy into the images and back "
                                  "at the restore, instead of criu's one parasite (docs/gpu.md, \"The host copy, "
                                  "copied in parallel\"); 0 leaves it to criu.")
    tcp_hold_max: int = _key(1024, "Most TCP connections between ranks of one job that one node holds while "
                             "only one end is restored (two packet filter rules each between ranks of the node, "
                             "one to another node): a capture above it is refused at its check, naming the count "
                             "(docs/mpi.md, \"TCP inside the job\").")
    proctrack_delegate: str = _key("proctrack/cgroup", "With ProctrackType=proctrack/slurmckpt: the site's own "
                                   "process tracking plugin, which slurmckpt delegates to (read by every new "
                                   "slurmstepd).")
    # Image store and staging (docs/storage.md). Sizes: bytes or a number with KiB/MiB/GiB; 0 = off.
    staging_dir: str = _key("/var/lib/slurmckpt/staging", "Node-local, root-only directory captures dump into "
                            "before their images are compressed into the store (local disk or tmpfs).")
    staging_max: int = _key(0, "Most bytes all of a node's staging areas may hold at once; 0 = no cap beyond the "
                            "file system's free space.", size=True)
    compression: str = _key("zstd", "How images are stored: zstd (independent frames, raw where zstd saves "
                            "little) or off. The policy may set it per partition or QOS.", choices=("zstd", "off"))
    compression_level: int = _key(1, "zstd level, 1 (fastest) to 19.")
    compression_threads: int = _key(2, "zstd worker threads of one rank's persist.")
    persist_nice: int = _key(10, "nice of a periodic capture's persist, which runs beside the job.")
    persist_io_class: str = _key("best-effort", "I/O class of a periodic capture's persist: best-effort (lowest "
                                 "level) or idle.", choices=("best-effort", "idle"))
    persist_timeout_s: float = _key(1800.0, "Seconds within which a rank's persist (compress and copy to the "
                                    "store) must finish, else the epoch aborts.")
    quota_job: int = _key(0, "Most bytes one job's images may take in the store; 0 = off.", size=True)
    quota_user: int = _key(0, "Most bytes one user's images, all jobs, may take in the store; 0 = off.", size=True)
    keep_finished: bool = _key(False, "Keep a finished job's images (debugging): `slurmckpt gc` leaves them.")
    store_wait_s: float = _key(120.0, "How long an agent waits for an image store that does not answer (a shared "
                               "file system's server down) before it gives up on it.")
    debug_stall_after: str = _key("", "Tests only: STAGE:SECONDS pauses every rank that long after STAGE.")
    log_target: str = _key("file", "Where agents log: file (one file per task in log_dir, rotated by size, old "
                           "tasks' files removed) or syslog (syslog_address; journald reads /dev/log).",
                           choices=("file", "syslog"))
    log_max_bytes: int = _key(16 << 20, "Size at which an agent's log file is rotated.", size=True)
    log_backups: int = _key(3, "Rotated copies kept per agent log file.")
    log_keep_days: int = _key(14, "Agent log files not written for this many days are removed when an agent "
                              "starts; 0 keeps them all.")
    syslog_address: str = _key("/dev/log", "The syslog socket for log_target: syslog.")
    metrics_textfile: str = _key("/var/lib/prometheus/node-exporter/slurmckpt.prom", "The Prometheus "
                                 "node_exporter textfile collector file the agents keep up to date (empty: none); %n "
                                 "is this node's name.")
    summary_dir: str = _key("/var/lib/slurmckpt/summaries", "Per-job summaries each job's user can read (epochs, "
                            "times, sizes, failed captures); on the same shared file system as storage_root.")
    # --checkpoint-interval=auto (coordinator/interval.py, interruptions.py; docs/operations.md, "Automatic
    # interval"). Durations as in the policy: off, N (minutes), 90s, 30m, 1h30m, 2d, MM:SS, HH:MM:SS.
    auto_first_interval: int = _key(600, "--checkpoint-interval=auto: the interval until a capture of the job has "
                                    "been measured (from then on Daly's interval for the measured stall), within "
                                    "the policy's min_interval and max_interval. The policy may set it per "
                                    "partition or QOS.", duration=True)
    interruption_mtbi: int = _key(86400, "auto: the mean time between interruptions of one node's run (node time "
                                  "per interruption) assumed where accounting knows little; accounting's history "
                                  "is weighed against it as if it were one interruption seen after this much node "
                                  "time. The policy may set it per partition or QOS.", duration=True)
    interruption_window: int = _key(7 * 86400, "auto: how far back the root agent reads the partition's job runs "
                                    "from accounting (sacct, at most once an hour per node and partition); off: "
                                    "accounting is not asked and interruption_mtbi alone counts.", duration=True,
                                    off=True)
    interruption_states: tuple[str, ...] = _key(("NODE_FAIL", "PREEMPTED"), "auto: the states of a job's run in "
                                                "accounting that count as an interruption. REQUEUED is not counted "
                                                "by default: slurmckpt's own requeues (wall-time, slurmckpt "
                                                "requeue) end so and lose no work.")
    job_comment_field: str = _key("AdminComment", "The job field slurmckpt's note and last checkpoint go to: "
                                  "AdminComment, Comment or none.", choices=("AdminComment", "Comment", "none"))
    policy: Policy = _key(factory=Policy, doc="Site policy per partition and QOS: see POLICY.", policy=True)
    source: str = field(default="(built-in defaults)", compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        check_compression(self.compression, self.compression_level, self.compression_threads)
        if not 0 <= self.persist_nice <= 19:
            raise ConfigError(f"key 'persist_nice': bad value {self.persist_nice!r}: want 0..19")
        if self.persist_io_class not in IOPRIO_CLASSES:
            raise ConfigError(f"key 'persist_io_class': bad value {self.persist_io_class!r}: want "
                              f"{' or '.join(IOPRIO_CLASSES)}")
        bad = [s for s in self.interruption_states if not re.fullmatch(r"[A-Z][A-Z_]*", s)]
        if bad or not self.interruption_states:
            raise ConfigError(f"key 'interruption_states': bad value {bad[0] if bad else '[]'!r}: want Slurm job "
                              "states as sacct prints them (NODE_FAIL, PREEMPTED, REQUEUED, ...)")
        if not os.path.isabs(self.staging_dir):
            raise ConfigError(f"key 'staging_dir': bad value {self.staging_dir!r}: want an absolute path")
        if self.tcp_hold_max < 1:
            raise ConfigError(f"key 'tcp_hold_max': bad value {self.tcp_hold_max!r}: want a number >= 1")

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
        """`path`, or the first of config_paths(environ) that exists; `environ` (user side only) may also
        override keys with SLURMCKPT_CFG_<KEY>."""
        values: dict[str, object] = {}
        if path is None:
            path = next((p for p in config_paths(environ) if p.exists()), None)
        if path is not None and path.exists():
            try:
                loaded = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from e
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: expected a mapping of keys to values")
            values.update(loaded)
        for key, value in (environ or {}).items():
            if key.startswith("SLURMCKPT_CFG_"):
                values[key[len("SLURMCKPT_CFG_"):].lower()] = value
        config = cls.from_mapping(values, source=str(path) if path else "config")
        return dataclasses.replace(config, source=str(path) if path and path.exists() else cls.source)

    @classmethod
    def from_mapping(cls, values: dict[str, object], source: str = "config") -> "Config":
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
        kwargs: dict[str, object] = {}
        for key, raw in values.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
            kwargs[key] = _field_value(fields[key], raw, source)
        return cls(**kwargs)  # type: ignore[arg-type]  # each value was coerced to its key's type (_field_value)

    def with_settings(self, settings: dict[str, object]) -> "Config":
        """This config with a job's policy settings (policy.JobPolicy.settings, already checked)."""
        return dataclasses.replace(self, **cast(dict[str, Any], settings)) if settings else self


def _field_value(f: dataclasses.Field[Any], raw: Any, source: str) -> object:
    if f.metadata.get("policy"):
        known = [n.name for n in dataclasses.fields(Config) if not n.metadata.get("internal")]
        return Policy.parse(raw, source, lambda key, value: _field_value(_FIELDS[key], value, "policy"), known)
    if f.metadata.get("size"):
        return _coerce(f.name, parse_size(f.name, raw, source), "int", source)
    if f.metadata.get("duration"):
        return parse_duration_key(f.name, raw, source, bool(f.metadata.get("off")))
    value = _coerce(f.name, raw, f.type, source)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{source}: key '{f.name}': bad value {raw!r}: want one of {', '.join(choices)}")
    return value


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_duration_key(key: str, raw: object, source: str = "config", off: bool = False) -> int:
    """Seconds of a duration key (the policy's grammar: duration.parse_duration); 0 only where `off` may be."""
    text = "off" if raw is False else str(raw).strip()        # YAML reads a bare `off` as false
    try:
        seconds = parse_duration(text)
    except ValueError as e:
        raise ConfigError(f"{source}: key '{key}': bad value {raw!r}: {str(e).split(': ', 1)[-1]}") from e
    if seconds == 0 and not off:
        raise ConfigError(f"{source}: key '{key}': bad value {raw!r}: must be a duration, not off")
    return seconds


def parse_size(key: str, raw: object, source: str = "config") -> int:
    """A byte count: an integer, or a number with a unit (KiB, MiB, GiB; K/M/G mean the same)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(raw))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{source}: key '{key}': bad value {raw!r}: want bytes or a number with KiB, MiB "
                          "or GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _coerce(key: str, raw: Any, typ: object, source: str) -> object:
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
            number = int(raw)
            if number < 0:
                raise ValueError("must be >= 0")
            return number
        if typ in ("float", float):
            real = float(raw)
            if not math.isfinite(real) or real <= 0:
                raise ValueError("must be a finite number > 0")
            return real
        if str(typ).startswith("tuple"):
            if isinstance(raw, str):
                return tuple(raw.split())
            return tuple(str(x) for x in raw)
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        return raw
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: key '{key}': bad value {raw!r}: {e}") from e


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def load_user_config() -> Config:
    return Config.load(environ=dict(os.environ))


def load_root_config() -> Config:
    """For root processes started by Slurm (the agent): fixed paths, and of the environment only
    SLURM_CONF (set by slurmstepd), never SLURMCKPT_* (docs/security.md)."""
    return Config.load(environ={k: v for k, v in os.environ.items() if k == "SLURM_CONF"})
