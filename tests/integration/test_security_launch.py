"""Attacks on the launch and capture side of the root agent, each run as an unprivileged job user against
the real cluster and agent: loader variables through sbatch --export, a working directory the user cannot
enter, the namespace init's directory, the freeze control, a tree held frozen through scancel, and an output fd
the user cannot read."""
from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
import uuid
from pathlib import Path

from slurmckpt.node import asuser
from slurmckpt.errors import PermissionDenied
from slurmckpt.identity import TreeName
from slurmckpt.node.launch import Credentials
from slurmckpt.node.task_cgroup import TaskCgroup
from tests.integration.slurmjob import node, proctrack_delegate, run, site_config, submit, task_cgroups, workdir, PGREP_HERE
from tests.integration.test_security import _agent_and_attacker

USER = "ckptuser1"
PRELOAD_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char line[256] = "", cap[64] = "?";
    FILE *s = fopen("/proc/self/status", "r"), *log = fopen(LOGFILE, "a");
    while (s && fgets(line, sizeof line, s))
        if (!strncmp(line, "CapEff:", 7)) sscanf(line + 7, "%63s", cap);
    if (log) fprintf(log, "pid=%d euid=%d capeff=%s\n", getpid(), geteuid(), cap);
    if (log) fclose(log);
    if (s) fclose(s);
}
"""


def _tree_pids(job_id: int) -> list[int]:
    return [pid for cg in task_cgroups(job_id) for pid in cg.pids()]


def _ns_init(job_id: int) -> int:
    for pid in _tree_pids(job_id):
        nspid = next(l for l in open(f"/proc/{pid}/status") if l.startswith("NSpid:")).split()[1:]
        if len(nspid) > 1 and nspid[-1] == "1":
            return pid
    raise AssertionError(f"job {job_id}: no PID-namespace init in its trees {_tree_pids(job_id)}")


def _build_preload(wd: Path, log: Path) -> Path:
    src, lib = wd / "mark.c", wd / "mark.so"
    src.write_text(PRELOAD_C)
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DLOGFILE="{log}"', "-o", str(lib), str(src)], check=True)
    os.chmod(lib, 0o755)
    return lib


def test_loader_variables_from_sbatch_export_never_reach_a_privileged_process() -> None:
    """LD_PRELOAD, LD_LIBRARY_PATH and GCONV_PATH exported by the user reach the workload (it runs as the
    user, without capabilities) and nothing that runs as root or with capabilities: every process that
    loaded the library logs a non-zero euid and an empty effective capability set, and the namespace init's
    environment holds none of them. The same library given to setpriv as root runs as uid 0 (the attack)."""
    wd = workdir(USER, "preload")
    log = Path(f"/var/tmp/slurmckpt-preload-{uuid.uuid4().hex}.log")
    log.touch()
    log.chmod(0o666)
    lib = _build_preload(wd, log)
    subprocess.run(["env", f"LD_PRELOAD={lib}", "/usr/bin/setpriv", "--reuid=65534", "true"], check=True)
    assert re.search(r"euid=0 ", log.read_text()), "the attack's premise: setpriv as root loads LD_PRELOAD"
    log.write_text("")
    job = submit(USER, wd, "#!/bin/bash\npython3 -c 'import time\nfor i in range(600): time.sleep(0.1)'\n",
                 "--checkpoint-interval=10s",
                 f"--export=ALL,LD_PRELOAD={lib},LD_LIBRARY_PATH={wd},GCONV_PATH={wd}")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        init = _ns_init(job.id)
        init_env = open(f"/proc/{init}/environ", "rb").read().split(b"\0")
        assert not [e for e in init_env if e.startswith((b"LD_", b"GCONV"))], init_env
        workload = [p for p in _tree_pids(job.id) if p != init]
        assert any(b"LD_PRELOAD=" + str(lib).encode() in open(f"/proc/{p}/environ", "rb").read()
                   for p in workload), "the user's environment must still reach the workload"
        lines = log.read_text().splitlines()
        assert lines, "the workload loaded the user's library"
        bad = [l for l in lines if " euid=0 " in l or not l.endswith("capeff=0000000000000000")]
        assert not bad, f"the user's library ran privileged: {bad}"
    finally:
        run("scancel", str(job.id))
        log.unlink(missing_ok=True)


def test_working_directory_is_entered_as_the_user() -> None:
    """A wrapper that asks for another user's 0700 directory as the tree's cwd: the tree starts in /tmp,
    since the directory is entered without privileges."""
    other = pwd.getpwnam("ckptuser2")
    private = Path(f"/var/tmp/slurmckpt-private-{uuid.uuid4().hex}")
    private.mkdir(mode=0o700)
    os.chown(private, other.pw_uid, other.pw_gid)
    attack = f"""
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["/bin/sh", "-c", "pwd; ls . 2>&1 | head -1"],
        env={{"PATH": "/usr/bin:/bin"}}, cwd="{private}")
os.close(w)
out = b""
while chunk := os.read(r, 4096):
    out += chunk
results.append(["output", "ok", out.decode()])
"""
    try:
        results = {name: (kind, detail) for name, kind, detail in _agent_and_attacker(USER, USER, attack)}
    finally:
        private.rmdir()
    assert results["launch"][0] == "ok", results
    out = results["output"][1]
    lines = out.splitlines()
    assert "/tmp" in lines and str(private) not in lines and "cannot chdir" in out, out


def test_user_can_touch_neither_the_init_directory_nor_the_freeze_control() -> None:
    """The namespace init's cwd (where CRIU's parasite mounts proc) is root's: the job's user can create,
    rename or replace nothing in it; the freeze control is root's: the user cannot freeze its own tree.
    Captures still work (the init creates the mount point with CAP_DAC_OVERRIDE)."""
    wd = workdir(USER, "initdir")
    job = submit(USER, wd, "#!/bin/bash\npython3 -c 'import time\nfor i in range(600): time.sleep(0.1)'\n",
                 "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        home = os.readlink(f"/proc/{_ns_init(job.id)}/cwd")
        st = os.stat(home)
        assert (st.st_uid, st.st_mode & 0o022) == (0, 0), f"{home} must be root's and not writable by others"
        for cmd in (["mkdir", f"{home}/proc.crtools"], ["ln", "-s", "/", f"{home}/proc.crtools"],
                    ["mv", home, f"{home}.moved"]):
            p = run(*cmd, user=USER, check=False)
            assert p.returncode != 0, f"{cmd} worked as the job's user"
        cg = task_cgroups(job.id)[0]
        word = "FROZEN" if cg.v1 else "1"
        p = run("sh", "-c", f"echo {word} > {cg.control}", user=USER, check=False)
        assert p.returncode != 0 and cg.state() == "THAWED", "the user froze its tree"
        job.wait_output(r"committed \(interval\)", 2, timeout=60)
    finally:
        run("scancel", str(job.id))


V1_TREES = Path("/sys/fs/cgroup/freezer/slurmckpt")    # freezer_root of a pure cgroup v1 host
STALL_S = 15
HELD = f"""freezer_root: {V1_TREES}
debug_stall_after: "freeze:{STALL_S}"
"""
# The job's user holds a process of its own in ptrace stops (every thread): unlike SIGSTOP, Slurm's SIGCONT
# at scancel does not resume it.
PTRACE_STALL = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
pid = int(sys.argv[1])
for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
    if libc.ptrace(0x4206, tid, None, None) or libc.ptrace(0x4207, tid, None, None):   # SEIZE, INTERRUPT
        sys.exit(f"ptrace {tid}: {os.strerror(ctypes.get_errno())}")
    os.waitpid(tid, 0x40000000)                                                        # __WALL
print("stalled", flush=True)
time.sleep(600)
"""


def _v1_trees(job_id: int) -> list[TaskCgroup]:
    return [TaskCgroup(p, tree) for p in sorted(V1_TREES.glob(f"{job_id}.*")) if (tree := TreeName.parse(p.name))]


def _pgrep(pattern: str) -> list[int]:
    return [int(p) for p in run(*PGREP_HERE, "-f", pattern, check=False).stdout.split()]


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_tree_its_user_holds_frozen_dies_with_the_job_on_a_v1_freezer() -> None:
    """The job's user stalls its own coordinator while the tree is frozen inside an epoch (between PREPARE and
    CAPTURE), then scancels the job. On a cgroup v1 freezer (a pure v1 host's; here freezer_root points there)
    a frozen process does not die of SIGKILL, and Slurm's final SIGKILL ends the agent and its thaw watchdog
    with the wrapper (proctrack/linuxproc, as docker-slurm runs, signals every process of the step; under
    proctrack/cgroup, whenever they land in the step's cgroup). Shown first: the tree is frozen there, a
    SIGKILL leaves its process frozen, the agent and its watchdog are among the pids Slurm kills, the
    coordinator is the user's and stalled. Then within KillWait (30 s) and a few seconds no process of the
    job is left, none frozen, no cgroup of its trees, and the node is not drained: slurmstepd ended the tree
    when it reaped the wrapper (spank/tree_end.c)."""
    wd = workdir(USER, "held-frozen")
    script = ("#!/bin/bash\nsleep 600 &\n"
              "python3 -c 'import time\nfor i in range(6000): time.sleep(0.1)'\n")
    where = node("node1")
    with proctrack_delegate("proctrack/linuxproc"), site_config(HELD):
        job = submit(USER, wd, script, "--checkpoint-interval=30m", "-w", where)
        job.wait_for(lambda: any(cg.pids() for cg in _v1_trees(job.id)), "the tree in a v1 freezer cgroup", 120)
    stall = None
    try:
        time.sleep(2)
        run("/opt/slurmckpt/venv/bin/slurmckpt", "checkpoint", str(job.id), user=USER)
        job.wait_for(lambda: any(cg.state() == "FROZEN" for cg in _v1_trees(job.id)), "the tree frozen", 60)
        coordinators = _pgrep(f"slurmckpt.coordinator.host --link [0-9]+ --job {job.id}$")
        assert len(coordinators) == 1, f"want the job's one coordinator, got {coordinators}"
        assert os.stat(f"/proc/{coordinators[0]}").st_uid == pwd.getpwnam(USER).pw_uid, "not the user's own"
        stall = subprocess.Popen(["runuser", "-u", USER, "--", "python3", "-c", PTRACE_STALL, str(coordinators[0])],
                                 stdout=subprocess.PIPE, text=True)
        assert stall.stdout.readline().strip() == "stalled", "the user could not stall its coordinator"
        (cg,) = _v1_trees(job.id)
        tree = cg.pids()
        sleeper = next(p for p in tree if open(f"/proc/{p}/comm").read().strip() == "sleep")
        os.kill(sleeper, 9)
        time.sleep(1)
        assert _alive(sleeper) and cg.state() == "FROZEN", "a v1-frozen process died of SIGKILL"
        helpers = _pgrep(f"slurmckpt agent .*--job {job.id} ")        # the agent and its thaw watchdog
        out = run("scontrol", "listpids", str(job.id), where).stdout
        listed = {int(l.split()[0]) for l in out.splitlines()[1:] if l.split() and l.split()[0].isdigit()}
        assert len(helpers) == 2 and set(helpers) <= listed, f"Slurm does not kill agent+watchdog {helpers}: {listed}"

        run("scancel", str(job.id), user=USER)
        start, thawed_early = time.monotonic(), False
        while any(map(_alive, helpers)) and time.monotonic() - start < 60:
            try:
                thawed_early = thawed_early or (cg.state() != "FROZEN" and bool(cg.pids()))
            except OSError:
                pass
            time.sleep(0.2)
        assert not any(map(_alive, helpers)), "Slurm's SIGKILL did not come within 60 s (KillWait=30)"
        assert not thawed_early, "the tree was thawed before Slurm's SIGKILL: the attack's premise failed"
        everything = tree + helpers + coordinators
        job.wait_for(lambda: not any(map(_alive, everything)), "no process of the job left", 15)
        assert not _v1_trees(job.id), f"cgroups of the job's trees left: {[c.path for c in _v1_trees(job.id)]}"
        assert time.monotonic() - start < 45
        state = run("sinfo", "-h", "-n", where, "-o", "%T").stdout.strip()
        assert "drain" not in state, f"{where} is {state}"
    finally:
        if stall is not None:
            stall.kill()
            stall.wait()
        for left in _v1_trees(job.id):             # what a successful attack left: never a frozen tree
            left.kill_all()
            left.remove()
        if "drain" in run("sinfo", "-h", "-n", where, "-o", "%T").stdout:
            run("scontrol", "update", f"nodename={where}", "state=resume")


def test_output_fd_the_user_cannot_read_is_never_copied() -> None:
    """A wrapper whose stdout is an O_PATH fd on a root-only file: the capture refuses it, and no image
    holds the file's content. Root itself could read it through /proc/PID/fd (the attack); the job user
    cannot."""
    secret = Path(f"/var/tmp/slurmckpt-secret-{uuid.uuid4().hex}")
    token = uuid.uuid4().hex
    secret.write_text(token)
    secret.chmod(0o600)
    fd = os.open(secret, os.O_PATH)
    try:
        assert open(f"/proc/self/fd/{fd}").read() == token, "the attack's premise: root reads an O_PATH fd"
        pw = pwd.getpwnam(USER)
        try:
            asuser.open_as_user(Credentials(pw.pw_uid, pw.pw_gid, (), ()), f"/proc/self/fd/{fd}", os.O_RDONLY)
            raise AssertionError("the job's user opened a root-only file")
        except PermissionDenied:
            pass
    finally:
        os.close(fd)
    attack = f"""
fd = os.open("{secret}", os.O_PATH)
os.dup2(fd, 1)
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["sleep", "30"], env={{"PATH": "/usr/bin:/bin"}}, cwd="/tmp")
attempt("prepare", "prepare", epoch=1)
attempt("capture", "capture", epoch=1, final=False)
"""
    try:
        results = {name: (kind, detail) for name, kind, detail in _agent_and_attacker(USER, USER, attack)}
        assert results["launch"][0] == "ok", results
        assert results["capture"][0] != "ok" and "O_PATH" in results["capture"][1], results
        leaked = subprocess.run(["grep", "-rl", token, "/var/lib/slurmckpt/images"], capture_output=True,
                                text=True).stdout
        assert not leaked, f"the secret was copied into {leaked}"
    finally:
        secret.unlink()


def test_special_file_stdout_is_not_copied() -> None:
    """A wrapper whose stdout is a character device (/dev/zero, endless when read): the capture copies
    nothing of it (only regular files are snapshotted) and still completes."""
    attack = """
fd = os.open("/dev/zero", os.O_RDWR)
os.dup2(fd, 1)
os.dup2(fd, 2)      # not the test runner's stderr (a file of root's, which the user may not read)
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["sleep", "30"], env={"PATH": "/usr/bin:/bin"}, cwd="/tmp")
attempt("prepare", "prepare", epoch=2)
attempt("capture", "capture", epoch=2, final=False)
attempt("resume", "resume", epoch=2)
"""
    results = {name: (kind, detail) for name, kind, detail in _agent_and_attacker(USER, USER, attack)}
    assert results["capture"][0] == "ok" and results["resume"][0] == "ok", results
    snaps = list(Path("/var/lib/slurmckpt/images").glob("*/990001/epoch-000002/*/output-*.snap"))
    assert not snaps, f"a special file was snapshotted: {snaps}"
