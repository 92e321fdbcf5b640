"""`slurmckpt` command line: thin layer over the modules; the catch-all error boundary for users."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import click

from slurmckpt.config import Config
from slurmckpt.duration import parse_duration
from slurmckpt.errors import SlurmckptError, SlurmError
from slurmckpt.slurm.control import CliSlurm
from slurmckpt.slurm.jobref import BadJobSpec, JobInfo, JobRef, parse_job_spec


class JobSpec(click.ParamType):
    """`N` or `N_M` (array task), nothing else: int() would read `1234_5` as job 12345."""
    name = "JOB_ID"

    def convert(self, value, param, ctx) -> JobRef:
        if isinstance(value, JobRef):
            return value
        try:
            return parse_job_spec(value)
        except BadJobSpec as e:
            self.fail(str(e), param, ctx)


JOB = JobSpec()


def resolve_job(ref: JobRef) -> JobInfo:
    from slurmckpt.slurm.jobref import resolve
    try:
        return resolve(ref, CliSlurm()._run)
    except SlurmckptError as e:
        raise click.ClickException(str(e)) from e


def job_id_of(ref: JobRef) -> int:
    """The job's id: N as written, an array task's own id through Slurm."""
    return ref.job if ref.task is None else resolve_job(ref).job_id


def shown(value: object) -> str:
    """What a user wrote (argv, a path, a reason), safe for a terminal: control characters and escape
    sequences come out escaped, repr-style; plain printable text as it is."""
    text = value if isinstance(value, str) else str(value)
    return text if text.isprintable() else repr(text)


@click.group()
def cli() -> None:
    """Transparent checkpoint/restore for Slurm jobs."""


@cli.command(hidden=True)
@click.option("--fd", type=int, required=True)
@click.option("--job", type=int, required=True)
@click.option("--step", required=True)
@click.option("--rank", type=int, required=True)
@click.option("--uid", type=int, required=True)
@click.option("--gid", type=int, required=True)
@click.option("--restart-count", type=int, default=0)
@click.option("--init", default=None)
def agent(fd, job, step, rank, uid, gid, restart_count, init) -> None:
    """Per-task privileged agent (started by the SPANK plugin only)."""
    if os.geteuid() != 0:
        raise click.ClickException("the agent runs as root, started by slurmstepd")
    from slurmckpt.agent import run_agent
    run_agent(fd, job, step, rank, uid, gid, restart_count, init)


@cli.command()
@click.argument("job", type=JOB)
@click.option("--requeue", is_flag=True, help="Capture, then requeue the job (it resumes from the capture).")
@click.option("--force", is_flag=True, help="Signal even if the job does not look checkpointable.")
def checkpoint(job: JobRef, requeue: bool, force: bool) -> None:
    """Capture JOB (N, or N_M for an array task) now (it keeps running unless --requeue)."""
    from slurmckpt.wrapper import CHECKPOINT_SIGNAL, REQUEUE_SIGNAL
    info = resolve_job(job)
    if os.geteuid() != 0 and info.uid != os.getuid():     # before any signal: only the job's owner (or root)
        raise click.ClickException(f"refused: job {job} belongs to uid {info.uid}, not to you (uid "
                                   f"{os.getuid()}); nothing was sent")
    job_id = info.job_id
    # The capture signal's default action ends a process: a job not started under slurmckpt would die of it.
    interval = None if force else submitted_interval(job_id)
    if interval == "unknown":
        raise click.ClickException(
            f"cannot tell whether job {job_id} runs under slurmckpt (accounting has no record of it); the "
            "capture signal would end a job that does not: nothing was sent (--force sends it anyway)")
    if not force and not interval_on(interval):
        raise click.ClickException(
            f"job {job_id} was not submitted with --checkpoint-interval (or it is off): it does not run under "
            "slurmckpt, and the capture signal would end it; nothing was sent (--force sends it anyway)")
    sig = int(REQUEUE_SIGNAL if requeue else CHECKPOINT_SIGNAL)
    # Slurm authorises the signal: only the job's owner (or an admin) can ask for its capture.
    try:
        CliSlurm().signal_batch(job_id, sig)
    except SlurmError as e:
        raise click.ClickException(f"scancel refused: {e}") from e
    click.echo(f"checkpoint of job {job_id} requested{' (then requeue)' if requeue else ''}")


INTERVAL_OPTION = re.compile(r"--checkpoint-interval(?:=|\s+)(\S+)")


def interval_in(submit_line: str, batch_script: str) -> str | None:
    """The --checkpoint-interval a job was submitted with: the command line wins over #SBATCH lines (as in
    sbatch). None when neither names it."""
    found = INTERVAL_OPTION.findall(submit_line)
    for line in batch_script.splitlines():
        if line.startswith("#SBATCH"):
            found = found or INTERVAL_OPTION.findall(line)
        elif line.strip() and not line.startswith("#"):
            break                        # sbatch stops reading #SBATCH at the first command
    return found[-1].strip("'\"") if found else None


def interval_on(value: str | None) -> bool:
    """Whether a --checkpoint-interval value turns checkpointing on, by the shim's own grammar (duration.py):
    0 in any spelling it accepts (off, 0, 0s, 0m, 00:00, 0:00:00, 0h0m...) is off, and so is a value it would
    have refused (the job cannot run under slurmckpt with it)."""
    if value is None:
        return False
    try:
        return parse_duration(value) > 0
    except ValueError:
        return False


def submitted_interval(job_id: int, wait_s: float = 20.0) -> str | None:
    """What the job was submitted with; "unknown" while accounting has no record of it (slurmdbd learns of
    a job a few seconds after its submission)."""
    slurm = CliSlurm()

    def ask(question, *args):
        try:
            return question(*args) or ""
        except SlurmError:
            return ""
    script = ask(slurm.batch_script, job_id)
    deadline = time.monotonic() + wait_s
    while True:     # the record can exist a while before its SubmitLine is filled in
        submit_line = ask(slurm.submit_line, job_id)
        if submit_line or time.monotonic() > deadline:
            break
        time.sleep(1)
    found = interval_in(submit_line, script)
    return found if (found or submit_line) else "unknown"


def _store_root(config: Config) -> Path:
    root = Path(config.storage_root)
    if not os.access(root, os.R_OK | os.X_OK):
        raise click.ClickException(f"{root} is readable by root only (images belong to root); run as root")
    return root


@cli.command(name="list")
@click.option("--json", "as_json", is_flag=True)
def list_cmd(as_json: bool) -> None:
    """Committed checkpoints of every job in the image store."""
    from slurmckpt.storage import JobStore, list_jobs
    config = Config.load()
    root = _store_root(config)
    rows = []
    for cluster, job in list_jobs(root):
        for e in JobStore(root, cluster, job).committed():
            rows.append({"cluster": cluster, "job": job, "epoch": e["epoch"], "reason": e["reason"],
                         "ranks": len(e["ranks"]), "committed_at": e["committed_at"]})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(f"{'CLUSTER':<12} {'JOB':>8} {'EPOCH':>6} {'REASON':<15} {'RANKS':>5}")
    for r in rows:
        click.echo(f"{shown(r['cluster']):<12} {r['job']:>8} {r['epoch']:>6} {shown(r['reason']):<15} "
                   f"{r['ranks']:>5}")


@cli.command()
@click.argument("job", type=JOB)
@click.option("--epoch", type=int, default=None, help="Default: the newest committed one.")
def inspect(job: JobRef, epoch: int | None) -> None:
    """What a checkpoint holds: ranks, processes, files, output snapshots, sizes, timings."""
    from slurmckpt.storage import JobStore, list_jobs
    config = Config.load()
    root = _store_root(config)
    job_id = job_id_of(job)
    clusters = [c for c, j in list_jobs(root) if j == job_id]
    if not clusters:
        raise click.ClickException(f"no checkpoint for job {job_id}")
    store = JobStore(root, clusters[0], job_id)
    epochs = store.committed()
    chosen = next((e for e in epochs if epoch in (None, e["epoch"])), None)
    if chosen is None:
        raise click.ClickException(f"job {job_id} has no committed epoch {epoch}")
    click.echo(f"job {job_id} epoch {chosen['epoch']} ({shown(chosen['reason'])}), {len(chosen['ranks'])} rank(s)")
    for name, record in sorted(chosen["ranks"].items()):
        if record["kind"] == "completed":
            click.echo(f"  {shown(name)}: completed before the capture, exit code {shown(record['exit_code'])}")
            continue
        step, _, rank = name.rpartition(".")
        m = store.read_rank_manifest(chosen["epoch"], step, int(rank))
        total = sum(f["size"] for f in m["files"].values())
        raw = sum(f.get("raw_size", f["size"]) for f in m["files"].values())
        click.echo(f"  {shown(name)}: {shown(m['kind'])} on {shown(m.get('node'))}, {shown(m.get('processes'))} "
                   f"process(es), {total / 2**20:.1f} MiB stored ({raw / 2**20:.1f} MiB raw) in "
                   f"{len(m['files'])} file(s), uid {shown(m.get('uid'))}")
        if m.get("argv"):
            click.echo(f"    argv: {' '.join(shown(a) for a in m['argv'])}")
        for o in m.get("outputs", []):
            click.echo(f"    output fd {shown(o['fd'])}: {shown(o['link'])} ({shown(o['size'])} B snapshot)")
        for t in m.get("truncate", []):
            click.echo(f"    written file: {shown(t['path'])} at {shown(t['size'])} B")
        if m.get("gpu"):
            click.echo(f"    gpu: {json.dumps(m['gpu'])}")
        click.echo(f"    timings: {json.dumps(m.get('timings', {}))}")


@cli.command()
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per removal, in a list.")
def gc(dry_run: bool, as_json: bool) -> None:
    """(root) Free what the image store no longer needs: every image of a job Slurm says will not run
    again (completed, cancelled, failed, timed out; never a pending or requeued one; `keep_finished: true`
    keeps them), uncommitted epochs whose coordinator can no longer commit them, and this node's staging
    areas whose agent is gone. Safe to run from cron on every node (docs/storage.md)."""
    from slurmckpt import reclaim
    from slurmckpt.staging import Staging
    from slurmckpt.storage import list_jobs
    if os.geteuid() != 0:
        raise click.ClickException("gc runs as root (the image store is root's)")
    config = Config.load()
    root = _store_root(config)
    slurm = CliSlurm()
    try:
        cluster = slurm.cluster_name() or "cluster"
    except SlurmError as e:
        raise click.ClickException(f"cannot learn the cluster's name from Slurm ({e}); nothing was removed")
    jobs = [job for c, job in list_jobs(root) if c == cluster]
    states = slurm.job_states(jobs) if jobs else {}
    removals = reclaim.collect_all(root, cluster, states, Staging(Path(config.staging_dir), config.staging_max),
                                   config.keep_finished, dry_run)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in removals], indent=1))
        return
    freed = [r for r in removals if r.kind != "kept"]
    for r in removals:
        verb = "kept" if r.kind == "kept" else ("would remove" if dry_run else "removed")
        click.echo(f"{verb:<12} {r.bytes / 2**30:8.2f} GiB  {shown(r.path)}  ({r.kind}: {shown(r.why)})")
    click.echo(f"{len(freed)} item(s), {sum(r.bytes for r in freed) / 2**30:.2f} GiB "
               f"{'would be freed (dry run)' if dry_run else 'freed'}")


@cli.command()
@click.argument("job", type=JOB, required=False)
def status(job: JobRef | None) -> None:
    """Jobs with checkpointing on: state, restarts, newest checkpoint and last failed capture (root sees
    the image store), and slurmckpt's note in the job's AdminComment (why it started from the beginning)."""
    job_id = job_id_of(job) if job else None
    try:
        lines = CliSlurm().queue("%i|%u|%T|%R", job_id)
    except SlurmError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"{'JOB':>8} {'USER':<12} {'STATE':<12} NODES/REASON")
    for line in lines:
        job, user, state, reason = (line.split("|") + ["", "", ""])[:4]
        click.echo(f"{shown(job):>8} {shown(user):<12} {shown(state):<12} {shown(reason)}")
    if os.geteuid() == 0 and job_id:
        from slurmckpt.storage import JobStore, list_jobs
        config = Config.load()
        for cluster, job in list_jobs(Path(config.storage_root)):
            if job == job_id:
                store = JobStore(Path(config.storage_root), cluster, job)
                epochs = store.committed()
                click.echo(f"newest checkpoint: epoch {epochs[0]['epoch']} ({shown(epochs[0]['reason'])})"
                           if epochs else "no committed checkpoint")
                show_failed_capture(store)
    if job_id:
        show_notes(job_id)


def show_failed_capture(store) -> None:
    from slurmckpt.fresh_start import failures
    failed = failures(store)
    if failed:
        f = failed[0]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.at))
        click.echo(f"last failed capture: {shown(f.describe())} (node {shown(f.node or '?')}, stage "
                   f"{shown(f.stage)}, {when})")


def show_notes(job_id: int) -> None:
    """What slurmckpt's agents told Slurm about the job (AdminComment, or Comment where that was refused)."""
    from slurmckpt.slurm.control import CliSlurm
    try:
        notes = CliSlurm(timeout_s=20).comments(job_id)
    except SlurmckptError:
        return
    for name, text in notes.items():
        if text.startswith("slurmckpt:"):
            click.echo(f"{name}: {shown(text)}")


@cli.command()
def doctor() -> None:
    """Check what slurmckpt needs: kernel, CRIU, plugstack line, agent, store."""
    from slurmckpt.criu import MIN_VERSION, CriuDriver
    config = Config.load()
    failures = 0

    def report(ok: bool, what: str, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        click.echo(f"[{'ok' if ok else 'FAIL'}] {what}{': ' + detail if detail else ''}")

    kconfig = Path(f"/boot/config-{os.uname().release}")
    report(Path("/proc/sys/kernel/ns_last_pid").exists(), "kernel: checkpoint/restore support",
           "ns_last_pid present" if not kconfig.exists() else str(kconfig))
    criu = CriuDriver(config.criu_path)
    if shutil.which(config.criu_path) or Path(config.criu_path).exists():
        try:
            version = criu.version()
            report(version >= MIN_VERSION, "criu version", ".".join(map(str, version)) +
                   ("" if version >= MIN_VERSION else f" (need >= {'.'.join(map(str, MIN_VERSION))})"))
        except SlurmckptError as e:
            report(False, "criu version", str(e))
        if os.geteuid() == 0:
            ok, text = criu.check()
            report(ok, "criu check", text.splitlines()[-1] if text else "")
    else:
        report(False, "criu", f"{config.criu_path} not found")
    plug = Path("/etc/slurm/plugstack.conf")
    lines = [l for l in (plug.read_text().splitlines() if plug.exists() else []) if "slurmckpt_spank" in l]
    report(bool(lines), "plugstack.conf line", lines[0] if lines else f"none in {plug}")
    so = lines[0].split()[1] if lines and len(lines[0].split()) > 1 else ""
    report(bool(so) and Path(so).exists(), "SPANK plugin", so)
    report(Path(config.init_path).exists(), "namespace init", config.init_path)
    agent = shutil.which("slurmckpt") or sys.argv[0]
    report(bool(agent), "agent entry point", agent)
    report(Path("/sys/fs/cgroup/freezer").exists() or Path("/sys/fs/cgroup/cgroup.controllers").exists(),
           "cgroup freezer", "v1" if Path("/sys/fs/cgroup/freezer").exists() else "v2")
    store = Path(config.storage_root)
    if store.exists():
        mode = store.stat().st_mode & 0o777
        report(store.stat().st_uid == 0 and mode & 0o077 == 0, "image store", f"{store} mode {mode:o}")
    else:
        report(False, "image store", f"{store} missing")
    staging = Path(config.staging_dir)
    if staging.is_symlink() or staging.exists():
        st = staging.lstat()
        free = shutil.disk_usage(staging).free if staging.is_dir() else 0
        report(staging.is_dir() and not staging.is_symlink() and st.st_uid == 0 and st.st_mode & 0o077 == 0,
               "staging", f"{staging} mode {st.st_mode & 0o777:o}, {free / 2**30:.1f} GiB free")
    else:
        report(True, "staging", f"{staging} (made root-only by the first capture)")
    if failures:
        raise click.ClickException(f"{failures} check(s) failed")


def main() -> None:
    try:
        cli(standalone_mode=True)
    except SlurmckptError as e:
        click.echo(f"slurmckpt: {e}", err=True)
        sys.exit(1)
