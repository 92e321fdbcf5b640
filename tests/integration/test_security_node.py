"""Attacks by a job's user on what the root side does with the user's files on the node (docs/security.md,
"Files the capture copies and the restore writes back"): a FIFO put at the job's own /dev/shm name must not
hold up another user's restore, and neither a sparse output file nor a /dev/shm file held open may make root
copy more than the capture counted and the quota allows. Every test fails if its attack works."""
from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.slurmjob import CONFIG, Job, node, run, submit, workdir
from tests.integration.test_store import CLI, store_of

NODE = "node3"
STAGING = Path("/var/lib/slurmckpt/staging")
RESTORED = r"restored from checkpoint epoch"
FAILED = r"restore of checkpoint epoch \d+ FAILED"


def _held(user: str, tag: str, shm: Path) -> Job:
    """A job of `user` on NODE mapping `shm` (its own /dev/shm file), captured by `scontrol requeuehold`
    and held: the images hold the file's content, and the restore writes it back under its name."""
    wd = workdir(user, f"node-{tag}")
    return submit(user, wd, f"#!/bin/bash\nrm -f {shm}; head -c 8192 /dev/zero > {shm}\n"
                            f"python3 pathhold.py --mode mmap --path {shm} --state state --steps 120 --sleep 0.5\n",
                  "-w", node(NODE), "--checkpoint-interval=30m")


def _blocks_for_a_writer(path: Path) -> bool:
    """The attack's premise: a plain open of `path` for writing (what the write-back did) waits."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(2)
        try:
            os.close(os.open(path, os.O_WRONLY))
            os._exit(0)
        except OSError:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM


def test_a_fifo_at_the_jobs_dev_shm_name_holds_up_no_other_users_restore() -> None:
    """ckptuser1 replaces its job's /dev/shm file with a FIFO while the job is held after its capture. Its
    restore used to open the FIFO for writing inside the node-wide restore lock and wait there for a reader
    that never came, and ckptuser2's restore on the same node waited behind it. Now ckptuser2's job
    restores, and ckptuser1's restore fails at once, saying why, and falls back to a fresh start."""
    tag = uuid.uuid4().hex[:8]
    shm1, shm2 = Path(f"/dev/shm/slurmckpt-fifo-{tag}-1"), Path(f"/dev/shm/slurmckpt-fifo-{tag}-2")
    attacker, victim = _held("ckptuser1", "fifo-attacker", shm1), _held("ckptuser2", "fifo-victim", shm2)
    try:
        for job in (attacker, victim):
            job.wait_output(r"pathhold step 3 |Error", timeout=90)
            assert "pathhold step 3 holds /dev/shm/slurmckpt-fifo-" in job.text(), job.text()[-2000:]
        for job in (attacker, victim):
            run("scontrol", "requeuehold", str(job.id))
        for job in (attacker, victim):
            job.wait_for(lambda job=job: job.state() == "PENDING", "the job requeued and held", 120)
            job.wait_output(r"(?:committed|captured) \(sigterm\)", timeout=30)
        run("sh", "-euc", f"rm -f {shm1}; mkfifo -m 600 {shm1}", user="ckptuser1")
        assert _blocks_for_a_writer(shm1), "premise: opening the FIFO for writing does not wait"
        run("scontrol", "release", str(attacker.id))
        attacker.wait_for(lambda: attacker.state() != "PENDING", "the attacker's job started", 60)
        time.sleep(3)                     # the attacker's restore is at its write-back by now
        run("scontrol", "release", str(victim.id))
        victim.wait_output(RESTORED + "|" + FAILED, timeout=90)
        assert re.search(RESTORED, victim.text()), f"ckptuser2's restore did not go through:\n{victim.text()[-3000:]}"
        attacker.wait_output(r"pathhold fresh start", timeout=60)
        text = attacker.text()
        assert RESTORED not in text and re.search(FAILED, text), text[-3000:]
        assert re.search(rf"cannot prepare /dev/shm for the restore: .*{shm1}.*not a regular file", text), text[-3000:]
    finally:
        for path in (shm1, shm2):
            path.unlink(missing_ok=True)


class SparseOutputJob(Job):
    """The output file is 1 TiB long and holds a few KiB (written at its end: slurmckpt makes the output
    O_APPEND): only its data is ever read."""

    def text(self) -> str:
        try:
            fd = os.open(self.output, os.O_RDONLY)
        except FileNotFoundError:
            return ""
        out, pos = b"", 0
        try:
            while len(out) < 4 << 20:
                try:
                    start = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError:          # ENXIO: no data after pos
                    break
                end = os.lseek(fd, start, os.SEEK_HOLE)
                out += os.pread(fd, min(end - start, 4 << 20), start)
                pos = end
        finally:
            os.close(fd)
        return out.replace(b"\0", b"").decode(errors="replace")


HOLDER = """import os, sys, time
name = sys.argv[1]
fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
for _ in range(96):
    os.write(fd, os.urandom(1 << 20))   # 96 MiB of data in /dev/shm, held open, never mapped
print("held", name, flush=True)
for k in range(900):
    if fd >= 0 and os.path.exists("release"):
        os.close(fd)
        os.unlink(name)
        fd = -1
        print("released", flush=True)
    print("step", k, flush=True)
    time.sleep(0.2)
"""


def _staging_bytes(job: int) -> int:
    total = 0
    for area in STAGING.glob(f"*.{job}/*"):
        for dirpath, _, names in os.walk(area):
            for name in names:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def _wait_bounded(job: Job, pattern: str, timeout: float = 90) -> None:
    """wait_output, but a capture copying the output's terabyte of holes (the attack) is cancelled as soon as
    staging holds 1 GiB of it: the test fails without filling the node's disk."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, job.text()):
        if _staging_bytes(job.id) > 1 << 30:
            run("scancel", str(job.id), check=False)
            raise AssertionError(f"job {job.id}: the capture copied more than 1 GiB into staging")
        assert time.monotonic() < deadline, f"job {job.id}: no {pattern!r}:\n{job.text()[-3000:]}"
        time.sleep(0.5)


@pytest.fixture
def quota_job_64mib():
    """Agents started meanwhile read quota_job: 64 MiB (replacing the admin config's value)."""
    original = CONFIG.read_text()
    kept = [line for line in original.splitlines() if not line.startswith("quota_job:")]
    CONFIG.write_text("\n".join(kept + [f"quota_job: {64 << 20}"]) + "\n")
    yield
    CONFIG.write_text(original)


def test_captures_copy_no_more_than_the_quota_and_the_reservation_count(quota_job_64mib) -> None:
    """`truncate -s 1T` on the job's own output and 96 MiB held open (not mapped) in /dev/shm, under
    quota_job 64 MiB. Neither is part of the tree's memory, which was all the quota check counted, while
    the capture copied both as root: the output up to its logical size (a terabyte of zeros into staging
    and the store). Now the held file is counted and the capture refused by name, the job runs on, and once
    the file is let go the capture copies the output's few KiB of data, not its terabyte."""
    wd = workdir("ckptuser1", "node-copies")
    (wd / "holder.py").write_text(HOLDER)
    os.chown(wd / "holder.py", wd.stat().st_uid, wd.stat().st_gid)
    shm = Path(f"/dev/shm/slurmckpt-held-{uuid.uuid4().hex[:8]}")
    plain = submit("ckptuser1", wd, "#!/bin/bash\ntruncate -s 1T \"slurm-$SLURM_JOB_ID.out\"\n"
                                    f"python3 holder.py {shm}\n", "--checkpoint-interval=30m")
    job = SparseOutputJob(plain.id, plain.workdir, plain.user)
    try:
        _wait_bounded(job, r"step 3\n")
        out = job.output.stat()
        assert out.st_size >= 1 << 40 and out.st_blocks * 512 < 1 << 20, "premise: a 1 TiB output costing nothing"
        assert shm.stat().st_blocks * 512 >= 96 << 20, "premise: 96 MiB held in /dev/shm"
        python = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith("python3\0holder.py")]
        memory = sum(_memory_kib(p) for p in python) << 10
        assert memory < 64 << 20, f"premise: the tree's memory ({memory} B) alone fits the quota"

        run(CLI, "checkpoint", str(job.id), user="ckptuser1")
        _wait_bounded(job, r"ABORTED \(rank [^,]+, node [^,]+, stage space\): .*over quota_job .*" + re.escape(str(shm)))
        assert job.state() == "RUNNING"
        assert _staging_bytes(job.id) < 16 << 20
        steps = len(re.findall(r"(?m)^step \d+$", job.text()))

        run("touch", str(wd / "release"), user="ckptuser1")
        _wait_bounded(job, r"released")
        run(CLI, "checkpoint", str(job.id), user="ckptuser1")
        _wait_bounded(job, r"committed \(manual\)")
        store = store_of(job.id)
        (epoch,) = [e["epoch"] for e in store.committed()]
        rank = store.read_rank_manifest(epoch, "batch", 0)
        assert rank.capture.outputs[0].fd == 1 and rank.capture.outputs[0].size > 1 << 40
        assert rank.seal.files["output-1.snap"]["raw_size"] < 1 << 20, rank.seal.files["output-1.snap"]
        stored = rank.seal.stored_bytes()
        assert stored < 64 << 20, f"the epoch stores {stored} bytes"
        time.sleep(1)
        assert job.state() == "RUNNING" and len(re.findall(r"(?m)^step \d+$", job.text())) > steps
    finally:
        run("scancel", str(job.id), check=False)
        for _ in range(60):
            if job.state() not in ("RUNNING", "COMPLETING"):
                break
            time.sleep(1)
        shm.unlink(missing_ok=True)
        job.output.unlink(missing_ok=True)


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def _memory_kib(pid: str) -> int:
    """What the old estimate counted of a process: RssAnon + RssShmem + VmSwap (kB)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssShmem", "VmSwap"):
                total += int(value.split()[0])
    except OSError:
        pass
    return total
