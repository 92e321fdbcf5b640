"""Drive the real test cluster from tests: submit as an unprivileged user, wait for states, read output."""
from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurmckpt.node.task_cgroup import TaskCgroup

WORKLOADS = Path(__file__).parent / "workloads"


def task_cgroups(job_id: int) -> list[TaskCgroup]:
    """The cgroups of this job's checkpointable trees on this host (all nodes share the kernel)."""
    from slurmckpt.identity import TreeName
    from slurmckpt.node.task_cgroup import TaskCgroup, default_root
    return [TaskCgroup(p, tree) for p in sorted(default_root().glob(f"{job_id}.*")) if (tree := TreeName.parse(p.name))]
WORK_ROOT = Path("/var/tmp/slurmckpt-work")
# pgrep limited to this PID namespace: the Slurm 24.11/26.05 roots beside the host cluster (scripts/test-suites.sh)
# run daemons, agents and coordinators with the same command lines in PID namespaces of their own
PGREP_HERE = ("pgrep", "--ns", str(os.getpid()), "--nslist", "pid")
AGENT_LOGS = Path("/var/log/slurmckpt")
SLURM_LOG_LINE = re.compile(r"\[\d{4}-\d\d-\d\dT[\d:.]+\] ")      # slurmstepd's lines in a job's output, 26.05


CONFIG = Path("/etc/slurmckpt/slurmckpt.yaml")


@contextmanager
def proctrack_delegate(plugin: str):
    """Run the jobs started inside under `plugin` (e.g. proctrack/linuxproc): proctrack/slurmckpt, the
    cluster's ProctrackType, reads its delegate from the config in every new slurmstepd."""
    saved = CONFIG.read_text()
    kept = [l for l in saved.splitlines() if not l.startswith("proctrack_delegate:")]
    CONFIG.write_text("\n".join(kept + [f"proctrack_delegate: {plugin}"]) + "\n")
    try:
        yield
    finally:
        CONFIG.write_text(saved)


@contextmanager
def site_config(text: str):
    """Run what is inside with `text` (YAML keys) added to the cluster's slurmckpt.yaml: agents read it when a
    task starts, `slurmckpt policy check` (cli_filter.lua) at every submission."""
    saved = CONFIG.read_text()
    CONFIG.write_text(saved.rstrip("\n") + "\n" + text)
    try:
        yield
    finally:
        CONFIG.write_text(saved)


def with_keys(text: str, **keys: object) -> str:
    """slurmckpt.yaml's `text` with these top-level keys set (a key it has is replaced: one may not repeat)."""
    kept = [line for line in text.splitlines() if line.split(":", 1)[0].strip() not in keys]
    return "\n".join(kept + [f"{k}: {json.dumps(v)}" for k, v in keys.items()]) + "\n"


@contextmanager
def site_keys(**keys: object):
    """Run what is inside with these keys of the cluster's slurmckpt.yaml set (`with_keys`): agents and
    `slurmckpt job-end` read them when they start."""
    saved = CONFIG.read_text()
    CONFIG.write_text(with_keys(saved, **keys))
    try:
        yield
    finally:
        CONFIG.write_text(saved)


SLURM_CONF = Path("/etc/slurm/slurm.conf")


@contextmanager
def slurm_conf(**keys: object):
    """Run what is inside with these slurm.conf keys set (`scontrol reconfigure`: slurmctld and every slurmd
    read them again; a step started before keeps what it read), then put slurm.conf back the same way. Only
    inside cluster-run.sh's lock: nobody else's job runs meanwhile."""
    saved = SLURM_CONF.read_text()
    text = saved
    for key, value in keys.items():
        line = f"{key}={value}"
        text, n = re.subn(rf"(?m)^{key}=.*$", line, text)
        text = text if n else text.rstrip("\n") + f"\n{line}\n"
    SLURM_CONF.write_text(text)
    try:
        run("scontrol", "reconfigure")
        time.sleep(2)                      # slurmd's reconfigure is asynchronous
        yield
    finally:
        SLURM_CONF.write_text(saved)
        run("scontrol", "reconfigure")
        time.sleep(2)


PLUGSTACK = Path("/etc/slurm/plugstack.conf")


@contextmanager
def plugin_args(*args: str):
    """Run what is inside with `args` added to the slurmckpt line of plugstack.conf (sbatch and every new
    slurmstepd read it; no daemon restarts)."""
    saved = PLUGSTACK.read_text()
    PLUGSTACK.write_text("\n".join(l + " " + " ".join(args) if "slurmckpt_spank.so" in l and not l.startswith("#")
                                   else l for l in saved.splitlines()) + "\n")
    try:
        yield
    finally:
        PLUGSTACK.write_text(saved)


def run(*cmd: str, user: str | None = None, check: bool = True, cwd: Path | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess:
    full = (["runuser", "-u", user, "--"] if user else []) + list(cmd)
    p = subprocess.run(full, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(full)} failed ({p.returncode}): {p.stdout}{p.stderr}")
    return p


def node(preferred: str) -> str:
    """`preferred` where the cluster has it, else its first node: tests that only want a node of their own on
    the 3-node host cluster run unchanged on a one-node cluster (the Slurm 24.11 root)."""
    names = run("sinfo", "-h", "-N", "-o", "%N").stdout.split()
    return preferred if preferred in names else sorted(names)[0]


def job_field(job: int, field: str) -> str | None:
    out = run("scontrol", "show", "job", str(job), check=False).stdout
    m = re.search(rf"\b{field}=(\S+)", out)
    return m.group(1) if m else None


@dataclass
class Job:
    id: int
    workdir: Path
    user: str

    @property
    def output(self) -> Path:
        return self.workdir / f"slurm-{self.id}.out"

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def app_lines(self) -> list[str]:
        """The workload's own lines: slurmckpt's, Slurm's and srun's messages filtered out (slurmstepd's start
        with "slurmstepd:" up to 25.11, with "[<ISO time>] " since 26.05)."""
        return [l for l in self.text().splitlines()
                if not l.startswith(("slurmckpt", "slurmstepd", "srun:", "Error (", "pie:", "---", "Warn"))
                and not SLURM_LOG_LINE.match(l)]

    def state(self) -> str:
        return job_field(self.id, "JobState") or "GONE"

    def restarts(self) -> int:
        return int(job_field(self.id, "Restarts") or 0)

    def wait_for(self, predicate, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(1)
        raise AssertionError(f"job {self.id}: timed out after {timeout}s waiting for {what}; state "
                             f"{self.state()}; output tail:\n" + "\n".join(self.text().splitlines()[-25:])
                             + self.agent_log_tails())

    def agent_log_tails(self, lines: int = 12) -> str:
        """The last lines of each of this job's agent logs on this host: what a timed-out wait could not see
        in the job's output (CI keeps only the test report)."""
        out = []
        for log in sorted(AGENT_LOGS.glob(f"agent-{self.id}.*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"\n--- {log.name} (last {len(tail)} lines):\n" + "\n".join(tail))
        return "".join(out)

    def wait_output(self, pattern: str, count: int = 1, timeout: float = 240) -> None:
        self.wait_for(lambda: len(re.findall(pattern, self.text())) >= count, f"{count}x {pattern!r}", timeout)

    def wait_running(self, timeout: float = 240) -> None:
        self.wait_for(lambda: self.state() == "RUNNING", "RUNNING", timeout)

    def wait_done(self, timeout: float = 400) -> str:
        self.wait_for(lambda: self.state() in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                               "OUT_OF_MEMORY"), "the end", timeout)
        return self.state()

    def requeue(self) -> None:
        run("scontrol", "requeue", str(self.id))

    def sacct(self) -> dict[str, tuple[str, str]]:
        out = run("sacct", "-n", "-P", "-j", str(self.id), "-o", "JobID,State,ExitCode", check=False).stdout
        rows = {}
        for line in out.splitlines():
            jid, state, code = line.split("|")
            rows[jid] = (state, code)
        return rows


def workdir(user: str, name: str) -> Path:
    pw = pwd.getpwnam(user)
    d = WORK_ROOT / user / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for f in WORKLOADS.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    for p in [d, *d.iterdir()]:
        os.chown(p, pw.pw_uid, pw.pw_gid)
    return d


def submit(user: str, wd: Path, script: str, *options: str) -> Job:
    path = wd / "job.sh"
    path.write_text(script)
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)
    path.chmod(0o755)
    out = run("sbatch", "--parsable", *options, "job.sh", user=user, cwd=wd).stdout
    return Job(int(out.strip().split(";")[0]), wd, user)


RESTORE_OUTCOME = r"restore of checkpoint epoch \d+ FAILED|restored from checkpoint epoch"


def release_expect_fallback(job: Job, because: str) -> str:
    """Release a held job whose restore must fail, be reported (`because` names the error) and fall back to
    a fresh start. Returns the job's output."""
    run("scontrol", "release", str(job.id))
    job.wait_output(RESTORE_OUTCOME, timeout=180)
    text = job.text()
    assert "restored from checkpoint epoch" not in text, \
        f"job {job.id}: the restore went through after the user's swap:\n{text[-3000:]}"
    assert re.search(because, text), f"job {job.id}: the restore failed for another reason:\n{text[-3000:]}"
    return text
