"""Job control behind one interface: the CLI backend (scontrol/squeue/sacct/scancel, always present) and
pyslurm when it is installed and built for the running Slurm's major version.

Every Slurm command slurmckpt runs goes through CliSlurm (one place per outside world): the CLI, the wrapper,
the agent and the membership code call its methods, never subprocess."""
from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import time
from typing import Any, Protocol

from slurmckpt.node import proctree
from slurmckpt.errors import SlurmError
from slurmckpt.slurm import jobrecord, queue, window
from slurmckpt.slurm.jobrecord import JobRecord
from slurmckpt.slurm.queue import QueuedJob
from slurmckpt.slurm.window import KillWindow

log = logging.getLogger("slurmckpt.slurm")


class JobUnknown(SlurmError):
    """slurmctld does not know the job (it never existed, or it ended longer than MinJobAge ago)."""


class JobEnded(SlurmError):
    """slurmctld still knows the job but it has ended, so it takes no more updates."""


# slurm_strerror's texts for an update of an ended job (ESLURM_JOB_FINISHED, ESLURM_ALREADY_DONE)
JOB_ENDED_TEXTS = ("Job has already finished", "already completing or completed")


class SlurmControl(Protocol):
    def requeue(self, job_id: int) -> None: ...
    def end_time(self, job_id: int) -> float | None: ...
    def job(self, job_id: int) -> dict[str, Any]: ...


class CliSlurm:
    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def _run(self, *cmd: str) -> str:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(f"{cmd[0]} failed: {e}", command=" ".join(cmd)) from e
        if p.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def requeue(self, job_id: int) -> None:
        start = time.monotonic()
        self._run("scontrol", "requeue", str(job_id))
        log.info("requeued job %d in %.2fs", job_id, time.monotonic() - start)

    def annotate(self, job_id: int, text: str, field: str = "AdminComment") -> str:
        """Root only: `text` (one sanitized line, slurm/comment.py) becomes the job's AdminComment (or
        `field`), which sacct and `scontrol show job` show; Comment when slurmctld refuses AdminComment.
        Returns the field set."""
        if field not in ("AdminComment", "Comment"):
            raise SlurmError(f"no such job comment field {field!r}", job=job_id)
        try:
            self._run("scontrol", "update", f"JobId={job_id}", f"{field}={text}")
            return field
        except SlurmError as first:
            if field == "Comment":
                raise
            try:
                self._run("scontrol", "update", f"JobId={job_id}", f"Comment={text}")
            except SlurmError as second:
                ended = any(t in str(first) for t in JOB_ENDED_TEXTS)
                raise (JobEnded if ended else SlurmError)(
                    f"neither AdminComment ({first}) nor Comment ({second}) could be set", job=job_id) from second
            log.warning("job %d: AdminComment refused (%s); the note went to Comment", job_id, first)
            return "Comment"

    def comments(self, job_id: int) -> dict[str, str]:
        """The job's AdminComment and Comment where set: from slurmctld while it knows the job, else from
        accounting's last record, both as JSON fields (the user's Comment may hold a newline and a forged
        `AdminComment=` line in the text forms)."""
        try:
            job = self.job(job_id)
            values = {"AdminComment": job.get("admin_comment"), "Comment": job.get("comment")}
        except SlurmError:
            records = jobrecord.jobs_of(self._json("sacct", "--json", "-X", "-j", str(job_id)))
            mine = [r for r in records if type(r.get("job_id")) is int and r["job_id"] == job_id]
            comment = mine[-1].get("comment") if mine else None
            comment = comment if isinstance(comment, dict) else {}
            values = {"AdminComment": comment.get("administrator"), "Comment": comment.get("job")}
        return {k: v.strip() for k, v in values.items() if isinstance(v, str) and v.strip()}

    def _json(self, *cmd: str) -> object:
        try:
            return json.loads(self._run(*cmd))
        except ValueError as e:       # JSONDecodeError; also a number too long to convert
            raise SlurmError(f"{cmd[0]} --json: not JSON ({e})") from e

    def job(self, job_id: int) -> dict[str, Any]:
        """The job's record in slurmctld (`squeue --json`, detail included: 22.05 lists every job whatever -j
        says, 23.02 and later just this one). Its fields differ by release: slurm/jobrecord.py reads them."""
        return jobrecord.job_entry(self._json("squeue", "--json", "-j", str(job_id)), job_id)

    def job_states(self, job_ids: list[int]) -> dict[int, str]:
        """Each job's state as slurmctld holds it (one word, slurm/queue.py: `PENDING`, `COMPLETING`,
        `REQUEUED`...), else, for a job slurmctld no longer holds, its last state in accounting; a job neither
        knows is missing from the answer. Each job is asked about alone (`squeue -j N`: slurmctld sends that
        job's record, never the whole queue of every user). slurmctld must answer (SlurmError otherwise): a
        job it holds may run again whatever accounting says of an earlier run (a requeued job's last record
        says PREEMPTED or REQUEUED until slurmdbd hears of the new one), and a job it no longer holds never
        runs again."""
        wanted, out = set(job_ids), {}
        for job in sorted(wanted):
            try:
                text = self._run("squeue", "-h", "-t", "all", "-O", queue.format_arg(queue.STATE_FIELDS),
                                 "-j", str(job))
            except SlurmError as e:
                if "Invalid job id" in str(e):         # slurmctld no longer holds it
                    continue
                raise
            state = queue.parse_states(text).get(job)
            if not state:       # squeue names a job it holds, and fails on one it does not: not understood
                raise SlurmError(f"squeue -j {job} answered without the job's state: {text.strip()[:200]!r}")
            out[job] = state
        rest = sorted(wanted - set(out))
        if rest:
            try:       # two fields no user writes: the id and Slurm's state word (`CANCELLED by 0`)
                rows = self._run("sacct", "-X", "-n", "-P", "-j", ",".join(map(str, rest)), "-o", "JobIDRaw,State")
            except SlurmError:
                rows = ""
            for line in rows.splitlines():
                raw, _, state = line.partition("|")
                if raw.strip().isdigit() and int(raw) in wanted and state.split():
                    out.setdefault(int(raw), state.split()[0])
        return out

    def signal_batch(self, job_id: int, signum: int) -> None:
        """`scancel --batch --signal`: only the batch shell gets it, and Slurm authorises it (the job's owner
        or an admin)."""
        self._run("scancel", "--batch", f"--signal={signum}", str(job_id))

    def batch_script(self, job_id: int) -> str:
        return self._run("scontrol", "write", "batch_script", str(job_id), "-")

    def submit_line(self, job_id: int) -> str | None:
        """The job's SubmitLine from accounting: None while accounting has no record of the job, "" while
        the record has no SubmitLine yet (slurmdbd fills it in a few seconds after the submission)."""
        line = self._run("sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobID,SubmitLine").strip()
        return line.partition("|")[2].strip() if line else None

    def queue(self, fmt: str, job_id: int | None = None) -> list[str]:
        """`squeue -h -o FMT [-j JOB]`, one line per job."""
        return self._run("squeue", "-h", "-o", fmt, *(["-j", str(job_id)] if job_id else [])).splitlines()

    def queued(self, jobs: list[str] | None = None, user: str | None = None) -> list[QueuedJob]:
        """The jobs slurmctld knows (`jobs`: ids as Slurm writes them, N or N_M; `user`: only theirs).
        A single job id slurmctld does not know raises JobUnknown (squeue: "Invalid job id specified")."""
        args = ["squeue", "-h", "-a", "-O", queue.format_arg()]
        if jobs:
            args += ["-j", ",".join(jobs)]
        if user:
            args += ["-u", user]
        try:
            return queue.parse(self._run(*args))
        except SlurmError as e:
            if "Invalid job id" in str(e):
                raise JobUnknown(f"Slurm knows no job {','.join(jobs or [])}") from e
            raise

    def accounted(self, job: str) -> dict[str, str] | None:
        """A job slurmctld forgot, from accounting (one `sacct` call with the caller's timeout): JobID,
        JobIDRaw, User, UID, State, Partition, QOS, NodeList, AdminComment, Comment; None if it has none."""
        keys = ("JobIDRaw", "JobID", "User", "UID", "State", "Partition", "QOS", "NodeList", "AdminComment",
                "Comment")
        out = self._run("sacct", "-n", "-X", "-P", "-j", job, "-o", ",".join(keys))
        rows = [dict(zip(keys, line.split("|", len(keys) - 1))) for line in out.splitlines() if line.strip()]
        return next((r for r in rows if job in (r.get("JobID"), r.get("JobIDRaw"))), None)

    def partition_runs(self, partition: str, window_s: int) -> list[tuple[str, int, int]]:
        """Every run of `partition`'s jobs (all users; each run of a requeued job, -D) in the last `window_s`
        seconds: (state word, elapsed seconds, nodes), from accounting (interruptions.py). Three fields no user
        writes, as parsable text; a line that is not three such fields is skipped."""
        out = self._run("sacct", "-a", "-X", "-D", "-n", "-P", "-r", partition, "-S", f"now-{int(window_s)}",
                        "-E", "now", "-o", "State,ElapsedRaw,NNodes")
        runs = []
        for line in out.splitlines():
            state, elapsed, nodes = (line.split("|") + ["", "", ""])[:3]
            words = state.split()
            if words and elapsed.strip().isdigit() and nodes.strip().isdigit():
                runs.append((words[0], int(elapsed), int(nodes)))
        return runs

    def update_job(self, job_id: int, **fields: str) -> None:
        """`scontrol update JobId=N Key=Value...` (as the caller: Slurm authorises it)."""
        self._run("scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items()))

    def node_state(self, node: str) -> dict[str, str]:
        """NodeName, State, Partitions of one node (`scontrol show node -o`); SlurmError if unknown."""
        line = self._run("scontrol", "show", "node", "-o", node).strip()
        return {k: v for k, _, v in (w.partition("=") for w in line.split()) if k in ("NodeName", "State",
                                                                                  "Partitions")}

    def config_values(self) -> dict[str, str]:
        """`scontrol show config` as {Key: value} (the admin's slurm.conf as slurmctld runs it)."""
        return window.config_values(self._run("scontrol", "show", "config"))

    def cluster_name(self, values: dict[str, str] | None = None) -> str | None:
        return (self.config_values() if values is None else values).get("ClusterName") or None

    def kill_window(self, partition: str, qos: str, values: dict[str, str] | None = None) -> KillWindow:
        """KillWait, and the GraceTime a preemption of a job in `partition` and `qos` adds (slurm/window.py):
        the partition's record (slurmctld) or the QOS's (slurmdbd), whichever PreemptType reads."""
        values = self.config_values() if values is None else values
        try:
            kill_wait = window.seconds_field(values.get("KillWait", str(window.DEFAULT_KILL_WAIT_S)), "KillWait")
            source = window.grace_source(values.get("PreemptType", ""), partition, qos)
            grace = 0
            if source.startswith("partition"):
                grace = window.partition_grace(self._run("scontrol", "show", "partition", "-o", partition))
            elif source:
                grace = window.qos_grace(self._run("sacctmgr", "-n", "-P", "show", "qos", qos,
                                                   "format=Name,GraceTime"), qos)
        except ValueError as e:
            raise SlurmError(f"Slurm's kill window: {e}") from e
        return KillWindow(kill_wait, grace, source if grace else "")

    def partition_graces(self) -> dict[str, int]:
        """Every partition's GraceTime (seconds), for `slurmckpt doctor`."""
        try:
            return window.partition_graces(self._run("scontrol", "show", "partition", "-o"))
        except ValueError as e:
            raise SlurmError(f"scontrol show partition: {e}") from e

    def preempted(self, job_id: int) -> bool:
        """Whether slurmctld is preempting the job's current run (its preempt_time is set, not before the
        run started): its SIGKILL then comes after GraceTime + KillWait."""
        return jobrecord.preempted(self.job(job_id))

    def default_partition(self) -> str | None:
        """The partition a job that names none runs in (Default=YES)."""
        for line in self._run("scontrol", "show", "partition", "-o").splitlines():
            fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
            if fields.get("Default") == "YES":
                return fields.get("PartitionName")
        return None

    def node_addr(self, node: str) -> str | None:
        """Slurm's NodeAddr of `node` (a name or address other nodes reach it at)."""
        m = re.search(r"\bNodeAddr=(\S+)", self._run("scontrol", "show", "node", node))
        return m.group(1) if m else None

    def end_time(self, job_id: int) -> float | None:
        job = self.job(job_id)
        end, limit = job.get("end_time"), job.get("time_limit")
        if isinstance(end, dict):                 # newer Slurm: {"set":..,"infinite":..,"number":..}
            end = end.get("number") if end.get("set") and not end.get("infinite") else None
        if isinstance(limit, dict):
            limit = None if limit.get("infinite") else limit.get("number")
        if not end or limit in (None, 0, 4294967295):
            return None
        return float(end)


class PyslurmControl:
    """Used only when pyslurm matches the running Slurm (PyPI has builds for 25.11 only)."""

    def __init__(self) -> None:
        import pyslurm  # noqa: F401 - availability check
        self.pyslurm = pyslurm

    def requeue(self, job_id: int) -> None:
        self.pyslurm.Job(job_id).requeue()

    def job(self, job_id: int) -> dict[str, Any]:
        record: dict[str, Any] = self.pyslurm.Job.load(job_id).to_dict()
        return record

    def end_time(self, job_id: int) -> float | None:
        job = self.pyslurm.Job.load(job_id)
        return float(job.end_time) if job.end_time and job.time_limit else None


SRUN = "srun"


def user_srun() -> str:
    """The srun the task's PATH finds: the one an MPI launcher in a batch script meant to run, which the
    batch wrapper runs for it outside the checkpointed tree (srun_relay.py). "" if there is none."""
    return shutil.which(SRUN) or ""


def slurm_major() -> str | None:
    try:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=10).stdout
        return ".".join(out.split()[1].split(".")[:2])
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


def default_control() -> SlurmControl:
    try:
        import pyslurm
        if slurm_major() and str(getattr(pyslurm, "__version__", "")).startswith(slurm_major() or "-"):
            return PyslurmControl()
    except ImportError:
        pass
    if shutil.which("scontrol") is None:
        raise SlurmError("scontrol not found: Slurm client tools are required")
    return CliSlurm()


# ---- the job as slurmctld knows it, by the trusted job id (slurm/jobrecord.py) ----------------------------
def job_record(job_id: int, timeout_s: float = 20.0) -> JobRecord:
    """The job's instance, partition, QOS, restart count, nodes and GPUs (the one call the root agent makes
    to learn them), from Slurm's JSON, never from the text form that holds the job's name and paths."""
    return jobrecord.parse_record(CliSlurm(timeout_s).job(job_id), job_id)


def other_node_addresses(nodes: list[str], hostname: str, slurm: "CliSlurm | None" = None) -> set[str]:
    """IP addresses of `nodes` (a job's nodes) other than the one this process runs on, from Slurm's NodeAddr,
    resolved: TCP to one of them is between the job's own ranks on two nodes."""
    import socket
    slurm = slurm or CliSlurm(timeout_s=10)
    me = this_node(sorted(nodes), hostname)
    found: set[str] = set()
    for node in nodes:
        if node == me:
            continue
        addr = slurm.node_addr(node) or node
        try:
            found |= {str(info[4][0]) for info in socket.getaddrinfo(addr, None)}
        except OSError:
            continue
    return found


def this_node(candidates: list[str], hostname: str, local: set[str] | None = None,
              timeout_s: float = 20.0) -> str | None:
    """Which of the job's nodes this process runs on: by NodeName or NodeHostname first, else by NodeAddr
    among the local addresses (never from the job's environment, SLURMD_NODENAME included). Node records
    are read as text: every field there is the admin's or the node's, none a job's."""
    if not candidates:
        return None
    short = hostname.split(".")[0]
    if hostname in candidates or short in candidates:
        return hostname if hostname in candidates else short
    try:
        text = CliSlurm(timeout_s)._run("scontrol", "show", "node", "-o", ",".join(candidates))
    except SlurmError:
        return None
    local = proctree.local_addresses() if local is None else local
    nodes = [(n.group(1), a.group(1) if a else "", h.group(1) if h else "")
             for line in text.splitlines() if (n := re.search(r"NodeName=(\S+)", line))
             for a, h in [(re.search(r"\bNodeAddr=(\S+)", line), re.search(r"\bNodeHost[Nn]ame=(\S+)", line))]]
    by_addr = [name for name, addr, _ in nodes if addr in local]
    by_host = [name for name, _, host in nodes if host in (hostname, short)]
    for found in (by_addr, by_host):        # one answer or none: several nodes may share a host name
        if len(found) == 1:
            return found[0]
    return None
