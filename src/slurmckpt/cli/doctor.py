"""`slurmckpt doctor`: what slurmckpt needs on this node, checked where Slurm and the kernel say it
(docs/operations.md, "Checking a node"). Exit code 1 when a check fails; warnings do not fail."""
from __future__ import annotations

import os
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import psutil

from slurmckpt.node import procfs
from slurmckpt.store import summary
from slurmckpt.cli.output import CliError, Column, Format, emit, output_options
from slurmckpt.config import Config, config_paths, load_user_config
from slurmckpt.errors import SlurmckptError
from slurmckpt.slurm.plugstack import read_chain, slurm_conf_path, slurm_conf_values

COLUMNS = [Column("result", "RESULT"), Column("check", "CHECK"), Column("detail", "DETAIL")]


@dataclass
class Report:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, ok: bool | None, check: str, detail: str = "") -> None:
        """ok None: a warning (reported, never a failure)."""
        self.rows.append({"result": "ok" if ok else "warn" if ok is None else "FAIL", "check": check,
                          "detail": detail})

    @property
    def failures(self) -> int:
        return sum(r["result"] == "FAIL" for r in self.rows)


def _private_dir(path: str, mode: int) -> tuple[bool, str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False, f"{path} missing"
    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) & ~mode == 0
    return ok, f"{path} owner uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):o} (want root, at most {mode:o})"


def check_config(r: Report) -> Config | None:
    try:
        cfg = load_user_config()
    except SlurmckptError as e:
        r.add(False, "config", str(e))
        return None
    looked = ", ".join(str(p) for p in config_paths(dict(os.environ)))
    r.add(True, "config", f"{cfg.source} (looked in: {looked})")
    if cfg.policy:
        r.add(True, "policy", f"{len(cfg.policy.partitions)} partition and {len(cfg.policy.qos)} QOS entries")
    return cfg


def check_criu(r: Report, cfg: Config) -> None:
    from slurmckpt.criu.driver import MIN_VERSION, CriuDriver
    criu = CriuDriver(cfg.criu_path)
    if not (shutil.which(cfg.criu_path) or Path(cfg.criu_path).exists()):
        r.add(False, "criu", f"{cfg.criu_path} not found")
        return
    try:
        version = criu.version()
        need = ".".join(map(str, MIN_VERSION))
        r.add(version >= MIN_VERSION, "criu version",
              ".".join(map(str, version)) + ("" if version >= MIN_VERSION else f" (need >= {need})"))
    except SlurmckptError as e:
        r.add(False, "criu version", str(e))
    if os.geteuid() == 0:
        ok, text = criu.check()
        r.add(ok, "criu check", text.splitlines()[-1] if text else "")
    check_network_lock(r, cfg)


def check_network_lock(r: Report, cfg: Config) -> None:
    """Which packet filter holds TCP around dumps and restores here (packet_filter.py), and that it works."""
    from slurmckpt.node import packet_filter
    method = packet_filter.method(cfg.network_lock)
    why = {"iptables": "iptables-restore found", "nftables": "no iptables here"}[method] \
        if cfg.network_lock == "auto" else f"network_lock: {cfg.network_lock}"
    if method == "nftables":
        ok = packet_filter.has_libnftables()
        r.add(ok, "network lock", f"nftables through libnftables ({why})" + ("" if ok else
              ": libnftables.so.1 is missing, so no TCP connection can be held (install libnftables1 or iptables)"))
    else:
        ok = packet_filter.has_iptables()
        r.add(ok, "network lock", f"iptables ({why})" + ("" if ok else ": iptables-restore is missing"))


def check_slurm(r: Report, cfg: Config) -> None:
    chain = read_chain()
    r.add(Path(chain.slurm_conf).exists(), "slurm.conf", chain.slurm_conf)
    r.add(bool(chain.files), "plugstack chain", " -> ".join(chain.files) or chain.plugstack)
    for problem in chain.problems:
        r.add(None, "plugstack chain", problem)
    line = chain.slurmckpt()
    if line is None:
        r.add(False, "plugstack.conf line", f"no line loads slurmckpt_spank.so in {', '.join(chain.files) or chain.plugstack}")
        return
    r.add(True, "plugstack.conf line", f"{line.file}:{line.line}: {line.kind} {line.path} {' '.join(line.args)}")
    r.add(line.resolved is not None, "SPANK plugin", line.resolved or f"{line.path} not found")
    for key, default in (("wrapper", None), ("agent", None), ("init", cfg.init_path)):
        path = line.arg(key) or default
        if path:
            r.add(os.access(path, os.X_OK), f"plugin {key}=", path)
    interval = line.arg("default_interval")
    if interval:
        r.add(chain.default_interval() != 0 or interval.lower() in ("off", "0"), "plugin default_interval=",
              interval)
    conf = slurm_conf_values(chain.slurm_conf, ("ProctrackType", "CliFilterPlugins"))
    r.add(True if conf.get("ProctrackType") == "proctrack/slurmckpt" else None, "ProctrackType",
          conf.get("ProctrackType", "(unset)") + ("" if conf.get("ProctrackType") == "proctrack/slurmckpt" else
                                                  ": programs with their own SIGTERM handler act on Slurm's "
                                                  "SIGTERM before the capture (docs/architecture.md)"))
    if cfg.policy:
        lua = Path(chain.slurm_conf).parent / "cli_filter.lua"
        on = "lua" in conf.get("CliFilterPlugins", "") and lua.exists() and "slurmckpt" in lua.read_text(errors="replace")
        r.add(True if on else None, "policy at submission", f"CliFilterPlugins={conf.get('CliFilterPlugins', '')}, "
              f"{lua}" + ("" if on else ": sbatch does not check the policy (the agents still enforce it)"))


GPU_SIZES_GIB = (8, 16, 32, 80)      # device memory per rank, for the KillWait/GraceTime a GPU job needs


def check_kill_window(r: Report, cfg: Config) -> None:
    """What Slurm gives a final capture (docs/operations.md, "The time Slurm gives a final capture"): KillWait
    and each partition's GraceTime, against the cost of a final capture at the rate of the captures in this
    cluster's store (else the budget's rates): how many GiB per rank fit, and what a GPU job of a given size
    needs. Informs; a job that does not fit is skipped and said, never lost silently."""
    from slurmckpt.agent.window import measured_here
    from slurmckpt.coordinator.budget import RankSize, final_capture_cost
    from slurmckpt.sizes import size_text
    from slurmckpt.slurm.control import CliSlurm
    from slurmckpt.slurm.window import seconds_field
    try:
        slurm = CliSlurm(timeout_s=20)
        values = slurm.config_values()
        kill_wait = seconds_field(values.get("KillWait", "30"), "KillWait")
        graces = slurm.partition_graces() if values.get("PreemptType", "").endswith("partition_prio") else {}
    except (SlurmckptError, ValueError) as e:
        r.add(None, "final capture window", f"Slurm did not say: {e}")
        return
    try:
        rate, count = measured_here(Path(cfg.storage_root), values.get("ClusterName") or "cluster")
    except OSError:
        rate, count = None, 0

    def need(gib: int) -> float:
        return final_capture_cost(RankSize("", "", 0, gib << 30, 1), rate).seconds

    def holds(window_s: float) -> str:
        low, high = 0, 4096
        while low < high:                       # GiB: the cost grows with the bytes
            mid = (low + high + 1) // 2
            low, high = (mid, high) if need(mid) <= window_s else (low, mid - 1)
        return f"~{low} GiB per rank" if low else "no GPU rank of 1 GiB"
    basis = (f"the rate of {count} capture(s) in this cluster's store ({size_text(rate.nbytes)} into staging in "
             f"{rate.fixed_s + rate.byte_s:.1f} s)" if rate else "the budget's rates (no capture in the store yet: "
             "docs/gpu.md)")
    needed = ", ".join(f"{g} GiB: {need(g):.0f} s" for g in GPU_SIZES_GIB)
    r.add(True if need(GPU_SIZES_GIB[0]) <= kill_wait else None, "final capture window",
          f"KillWait {kill_wait} s (requeue, scancel, time limit) holds the final capture of {holds(kill_wait)} at "
          f"{basis}; a GPU rank's final capture needs {needed} (KillWait, or GraceTime + KillWait when preempted); "
          "larger ones are skipped and said, and their requeue restores the last periodic checkpoint")
    for partition, grace in sorted(graces.items()):
        if grace:
            r.add(True, f"final capture window, partition {partition}",
                  f"preemption: GraceTime {grace} s + KillWait {kill_wait} s holds {holds(grace + kill_wait)}")


def check_node(r: Report, cfg: Config) -> None:
    r.add(procfs.kernel_has("ns_last_pid"), "kernel: checkpoint/restore support", "ns_last_pid")
    r.add(Path(cfg.init_path).exists(), "namespace init", cfg.init_path)
    agent = shutil.which("slurmckpt") or sys.argv[0]
    r.add(bool(agent), "agent entry point", agent)
    v1 = Path("/sys/fs/cgroup/freezer").exists()
    r.add(v1 or Path("/sys/fs/cgroup/cgroup.controllers").exists(), "cgroup freezer", "v1" if v1 else "v2")
    ok, detail = _private_dir(cfg.storage_root, 0o700)
    r.add(ok, "image store", detail)
    staging = Path(cfg.staging_dir)
    if staging.is_symlink() or staging.exists():
        ok, detail = _private_dir(cfg.staging_dir, 0o700)
        free = shutil.disk_usage(staging).free if ok else 0
        r.add(ok, "staging", f"{detail}, {free / 2**30:.1f} GiB free")
    else:
        r.add(True, "staging", f"{staging} (made root-only by the first capture)")
    ok, detail = _private_dir(cfg.summary_dir, 0o755)
    r.add(ok if os.path.exists(cfg.summary_dir) else None, "job summaries",
          detail if os.path.exists(cfg.summary_dir) else f"{cfg.summary_dir} missing (agents create it)")
    if ok:
        try:
            acls = summary.users_can_read(cfg.summary_dir)
        except OSError as e:
            acls, why = None, f"could not try POSIX ACLs there: {e}"
        else:
            why = "POSIX ACLs: each job's user can read its summary" if acls else \
                "no POSIX ACLs on this file system: summaries stay root's, users cannot read theirs"
        r.add(acls or None, "job summaries for their users", why)
    if cfg.log_target == "file":
        ok, detail = _private_dir(cfg.log_dir, 0o700)
        r.add(ok, "agent logs", f"file, rotated at {cfg.log_max_bytes} bytes x{cfg.log_backups}: {detail}")
    else:
        r.add(os.path.exists(cfg.syslog_address), "agent logs", f"syslog at {cfg.syslog_address}")
    if cfg.metrics_textfile:
        target = Path(cfg.metrics_textfile.replace("%n", os.uname().nodename.split(".")[0]))
        r.add(True if target.parent.is_dir() else None, "metrics textfile",
              f"{target}" + ("" if target.parent.is_dir() else " (directory missing: agents create it; point "
                                                              "node_exporter's --collector.textfile.directory there)"))
    agents = running_agents()
    r.add(True, "agents running here", ", ".join(f"{a['task']} (pid {a['pid']})" for a in agents) or "none")
    from slurmckpt.cuda.inventory import doctor_checks
    for gpu_ok, what, detail in doctor_checks(staging=Path(cfg.staging_dir)):    # GPU nodes only (docs/gpu.md)
        r.add(gpu_ok, what, detail)


def running_agents() -> list[dict[str, Any]]:
    """`slurmckpt agent` processes on this node (psutil): job.step.rank and pid (not their watchdogs, which
are forked children with the same command line)."""
    found = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        argv = p.info["cmdline"] or []
        at = next((i for i, a in enumerate(argv[:3]) if os.path.basename(a) == "slurmckpt"), None)
        if at is not None and argv[at + 1:at + 2] == ["agent"]:
            opts = dict(zip(argv[at + 2::2], argv[at + 3::2]))
            found.append({"pid": p.info["pid"], "ppid": p.info["ppid"],
                          "task": f"{opts.get('--job')}.{opts.get('--step')}.{opts.get('--rank')}"})
    pids = {a["pid"] for a in found}
    return [{"pid": a["pid"], "task": a["task"]} for a in found if a["ppid"] not in pids]


@click.command()
@output_options
def doctor(fmt: Format) -> None:
    """Check what slurmckpt needs here: kernel, CRIU, the config, the SPANK plugin chain as slurm.conf's
    PlugStackConfig and its includes load it, the agent, cgroups, the image store, logs, metrics."""
    r = Report()
    cfg = check_config(r)
    if cfg is not None:
        check_criu(r, cfg)
        check_slurm(r, cfg)
        check_kill_window(r, cfg)
        check_node(r, cfg)
    if fmt.kind == "text":
        for row in r.rows:
            click.echo(f"[{row['result']}] {row['check']}" + (f": {row['detail']}" if row["detail"] else ""))
    else:
        emit(fmt, COLUMNS, r.rows, {"checks": r.rows, "failures": r.failures, "slurm_conf": slurm_conf_path()})
    if r.failures:
        raise CliError(f"{r.failures} check(s) failed")
