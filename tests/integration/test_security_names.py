"""Names root makes for a job's files: never through a path the job's user can bend, never one another user
can take first (docs/security.md, "Names criu makes").

A file a process holds by a removed name while another name of it remains (glibc's sem_open in /dev/shm;
any program anywhere) is dumped by criu only with --link-remap, which makes a new name for it in the removed
name's directory. Stock criu makes it as root, by path: a user who swaps that directory for a symlink gets
root to hard-link the user's file into /etc or into another user's 0700 directory; its names are
link_remap.<small number>, so another user who makes them first fails every such capture and restore.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import time
from pathlib import Path

from tests.integration.slurmjob import node, run, submit, workdir

USER, OTHER = "ckptuser1", "ckptuser2"
CLI = "/usr/local/bin/slurmckpt"
CRIU = "/usr/local/sbin/criu"
ROOT_DIR = Path("/etc/slurmckpt-test-links")        # a root directory under /etc: no user may put a name there
NODE = "node2"


def _root_dir() -> Path:
    shutil.rmtree(ROOT_DIR, ignore_errors=True)
    ROOT_DIR.mkdir(mode=0o755)
    return ROOT_DIR


def _victim_dir() -> Path:
    """A 0700 directory of the other user: the job's user can neither list nor write it."""
    home = Path(pwd.getpwnam(OTHER).pw_dir) / "private-links"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(mode=0o700)
    pw = pwd.getpwnam(OTHER)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    return home


def _swap_for_symlink(directory: Path, target: Path) -> None:
    """As the job's user: the directory its process's removed name was in, replaced by a symlink."""
    run("bash", "-c", f"rm -rf {directory} && ln -s {target} {directory}", user=USER)
    assert directory.is_symlink()


def test_a_directory_swapped_for_a_symlink_gets_roots_link_into_neither_etc_nor_another_users_home() -> None:
    """The audit's attack through `slurmckpt checkpoint --requeue`: the job holds a semaphore (so the capture
    needs criu's --link-remap) and w1/a/f, w2/a/f by removed names with second names; the user replaces w1/a
    with a symlink to a root directory under /etc and w2/a with one to another user's 0700 directory. The
    capture is refused before anything is frozen, naming the files; nothing appears in either directory."""
    wd = workdir(USER, "relink-attack")
    root_dir, victim = _root_dir(), _victim_dir()
    job = submit(USER, wd, "#!/bin/bash\npython3 relinkhold.py --sem slurmckpt-relink-$SLURM_JOB_ID "
                 "--relink w1 --relink w2 --steps 900 --sleep 0.2 --ready ready\n",
                 "-w", node(NODE), "--checkpoint-interval=30m")
    try:
        job.wait_output(r"relinkhold step 3 ", timeout=120)
        _swap_for_symlink(wd / "w1" / "a", root_dir)
        _swap_for_symlink(wd / "w2" / "a", victim)
        run(CLI, "checkpoint", "--requeue", str(job.id), user=USER, check=False)
        job.wait_output(r"ABORTED \(rank [\w.]+, node [^,]+, stage check\)", timeout=120)
        text = job.text()
        assert re.search(r"holds \S*/w1/a/f by a removed name while the file keeps another name", text), text[-3000:]
        assert list(root_dir.iterdir()) == [], f"root made names in {root_dir}: {list(root_dir.iterdir())}"
        assert list(victim.iterdir()) == [], f"root made names in {victim}: {list(victim.iterdir())}"
    finally:
        run("scancel", str(job.id), check=False)


def _hold_as_user(wd: Path, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["runuser", "-u", USER, "--", "python3", "relinkhold.py", *args, "--steps", "3000",
                             "--ready", "ready"], cwd=wd, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while not (wd / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "relinkhold did not get ready"
        time.sleep(0.1)
    return proc


def _criu_dump(pid: int, images: Path) -> subprocess.CompletedProcess[str]:
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir()
    return subprocess.run([CRIU, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4",
                           "--link-remap", "--shell-job"],
                          capture_output=True, text=True, timeout=120)


def test_criu_dump_links_a_removed_name_only_where_the_task_could_and_by_a_name_nobody_can_guess() -> None:
    """Our criu itself, for the race slurmckpt's check cannot close (the user removes a name after the check):
    with the directory swapped for a symlink (to root's directory under /etc, to another user's 0700
    directory) the dump fails and makes no name anywhere; without the swap it links the file, as the task,
    in the task's own directory, under link_remap.<64 random bits>; the names another user made first
    (link_remap.0..2999 in /dev/shm) fail nothing."""
    wd = workdir(USER, "relink-criu")
    images = Path("/var/lib/slurmckpt-test-relink")
    root_dir, victim = _root_dir(), _victim_dir()
    squatted = [Path(f"/dev/shm/link_remap.{i}") for i in range(3000)]
    run("bash", "-c", "cd /dev/shm && for i in $(seq 0 2999); do : > link_remap.$i; done", user=OTHER)
    try:
        for target in (root_dir, victim):
            proc = _hold_as_user(wd, "--sem", f"slurmckpt-relink-{os.getpid()}", "--relink", "w")
            try:
                _swap_for_symlink(wd / "w" / "a", target)
                done = _criu_dump(proc.pid, images)
                log = (images / "dump.log").read_text()
                assert done.returncode != 0, "criu dumped through the symlink"
                # a directory the task cannot search fails at the stat, one it can at opening the directory
                assert re.search(r"a symlink on the way|cannot reach .+ by its path any more", log), log[-2000:]
                assert list(target.iterdir()) == [], f"criu made names in {target}: {list(target.iterdir())}"
                assert proc.poll() is None, "a failed dump must leave the process running"
            finally:
                proc.kill()
                proc.wait()
                shutil.rmtree(wd / "w", ignore_errors=True)
                (wd / "ready").unlink(missing_ok=True)
        proc = _hold_as_user(wd, "--sem", f"slurmckpt-relink-{os.getpid()}", "--relink", "w")
        done = _criu_dump(proc.pid, images)
        proc.wait(timeout=30)
        assert done.returncode == 0, (images / "dump.log").read_text()[-2000:]
        made = [p.name for p in (wd / "w" / "a").iterdir()]
        assert len(made) == 1 and re.fullmatch(r"link_remap\.[0-9a-f]{16}", made[0]), made
        assert (wd / "w" / "a" / made[0]).stat().st_ino == (wd / "w" / "keep").stat().st_ino
        assert all(p.stat().st_uid == pwd.getpwnam(OTHER).pw_uid for p in squatted)
    finally:
        run("bash", "-c", "rm -f /dev/shm/link_remap.*", user=OTHER, check=False)
        run("bash", "-c", "rm -f /dev/shm/link_remap.* /dev/shm/sem.slurmckpt-relink-*", user=USER, check=False)
        shutil.rmtree(images, ignore_errors=True)


def _rank_records(job_id: int) -> list[Path]:
    return sorted(Path("/var/lib/slurmckpt/images").glob(f"*/{job_id}/epoch-*/*/rank.json"))


def test_names_another_user_made_first_fail_neither_the_capture_nor_the_restore() -> None:
    """Another user on the node makes /dev/shm/link_remap.0..2999 (criu's old names) before the job starts,
    then, while the job is requeued and held, the very link_remap names the capture used (as anyone could
    watch them appear in /dev/shm) and the old ghost names of the job's removed /tmp file. The job, holding a
    semaphore and that file, is captured at an interval and at the requeue, restored mid-run and ends with
    the lines of an uninterrupted run."""
    wd = workdir(USER, "squat")
    ghost = f"/tmp/slurmckpt-squat-{os.getpid()}"
    prog = f"python3 relinkhold.py --sem slurmckpt-squat-{os.getpid()} --ghost {ghost} --steps 150 --sleep 0.2"
    ref = run("bash", "-c", prog.replace("--sleep 0.2", "--sleep 0"), user=USER, cwd=wd, timeout=120).stdout
    run("bash", "-c", f"rm -f /dev/shm/sem.slurmckpt-squat-{os.getpid()}", user=USER)
    run("bash", "-c", "cd /dev/shm && for i in $(seq 0 2999); do : > link_remap.$i; done", user=OTHER)
    job = submit(USER, wd, f"#!/bin/bash\n{prog}\n", "-w", node(NODE), "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)", timeout=180)
        run("scontrol", "requeuehold", str(job.id))          # the final capture, then held
        job.wait_for(lambda: job.state() == "PENDING", "the job requeued and held", 120)
        used = {link for rec in _rank_records(job.id)
                for e in json.loads(rec.read_text()).get("shm_files", []) for link in e["links"]}
        assert used, "the capture made no link remap: the test does not exercise it"
        names = " ".join([*used, *(f"{ghost}.cr.{i:x}.ghost" for i in range(64))])
        run("bash", "-c", f"for n in {names}; do : > $n; done", user=OTHER)
        run("scontrol", "release", str(job.id))
        job.wait_output(r"restored from checkpoint epoch", timeout=240)
        assert job.wait_done(timeout=300) == "COMPLETED", job.text()[-3000:]
        assert job.app_lines() == ref.splitlines(), job.text()[-3000:]
    finally:
        run("scancel", str(job.id), check=False)
        run("bash", "-c", f"rm -f /dev/shm/link_remap.* {ghost}.*", user=OTHER, check=False)
        run("bash", "-c", f"rm -f /dev/shm/sem.slurmckpt-squat-* {ghost}*", user=USER, check=False)
