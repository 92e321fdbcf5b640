"""What users write that root reads or shows: a job's summary (root's file its user can read but not
change; root's CLI parses it defensively and is not steered by a file root did not write), TIME_WAIT
sockets of another user on the ports a restore frees, and user strings in root's agent log. Each test
fails if its attack works."""
from __future__ import annotations

import json
import os
import pwd
import re
import sys
import time
from pathlib import Path

from tests.integration.slurmjob import WORK_ROOT, run, submit, workdir

PY = sys.executable
CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
SUMMARIES = Path("/var/lib/slurmckpt/summaries")

# ckptuser1 against its own job's summary: read it, then try every way to change or replace it
SUMMARY_ATTACK = r"""
import errno, json, os, sys
path = sys.argv[1]
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
out = {"uid": os.getuid()}
try:
    out["job"] = json.load(open(path))["job"]
except OSError as e:
    out["job"] = errno.errorcode.get(e.errno, str(e))
out["write"] = attempt(lambda: os.open(path, os.O_WRONLY))
out["chmod"] = attempt(lambda: os.chmod(path, 0o600))
out["rename"] = attempt(lambda: os.rename(path, path + ".mine"))
out["unlink"] = attempt(lambda: os.unlink(path))
out["create"] = attempt(lambda: os.open(path + ".new", os.O_WRONLY | os.O_CREAT, 0o600))
print(json.dumps(out))
"""


def _as(user: str, code: str, *args: str) -> dict:
    script = WORK_ROOT / user / "surface_attack.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(code)
    script.chmod(0o644)
    return json.loads(run("runuser", "-u", user, "--", PY, str(script), *args).stdout.strip().splitlines()[-1])


def _cluster() -> str:
    return re.search(r"ClusterName\s*=\s*(\S+)", run("scontrol", "show", "config").stdout).group(1)


def test_a_user_cannot_rewrite_its_summary_and_the_cli_is_not_steered_by_one_root_did_not_write() -> None:
    """The old summary was the job user's file (0400, but theirs to chmod and rewrite), and root's CLI
    parsed it: deep nesting crashed `slurmckpt status`, and a run record saying "disabled" made root's
    `slurmckpt checkpoint` refuse a job that runs under slurmckpt. Now the file is root's, the user reads it
    (ACL) and can neither write, chmod, replace nor remove it, other users cannot read it, and a file root
    did not write (the user's, as the old one was) or cannot parse is ignored, never a crash."""
    wd = workdir("ckptuser1", "surface-summary")
    job = submit("ckptuser1", wd, "#!/bin/bash\nsleep 300\n", "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)", timeout=120)
        path = SUMMARIES / _cluster() / f"{job.id}.json"
        st = path.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o440), (st.st_uid, oct(st.st_mode))
        mine = _as("ckptuser1", SUMMARY_ATTACK, str(path))
        assert mine["uid"] == pwd.getpwnam("ckptuser1").pw_uid and mine["job"] == job.id, mine
        assert (mine["write"], mine["chmod"], mine["rename"], mine["unlink"], mine["create"]) == \
            ("EACCES", "EPERM", "EACCES", "EACCES", "EACCES"), f"the job's user could change its summary: {mine}"
        assert _as("ckptuser2", SUMMARY_ATTACK, str(path))["job"] == "EACCES"
        assert re.search(r"newest checkpoint: epoch \d+", run(CLI, "status", str(job.id), user="ckptuser1").stdout)

        # what a user could write before: deep nesting, then a run record that disables checkpoints, in a
        # file of its own (root puts them there here: the user no longer can)
        saved = path.read_bytes()
        pw = pwd.getpwnam("ckptuser1")
        path.write_bytes(b"[" * 200_000)
        p = run(CLI, "status", str(job.id), check=False)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        summary = json.loads(saved)
        summary["run"]["disabled"] = "forged by the job's user"
        path.write_text(json.dumps(summary))
        os.chown(path, pw.pw_uid, pw.pw_gid)
        os.chmod(path, 0o600)
        p = run(CLI, "status", str(job.id))
        assert "forged" not in p.stdout and "no checkpoint summary visible" in p.stdout, p.stdout
        p = run(CLI, "checkpoint", str(job.id), check=False)
        assert p.returncode == 0 and "disabled" not in p.stdout + p.stderr, p.stdout + p.stderr
        job.wait_output(r"committed \(manual\)", timeout=90)
        assert job.state() == "RUNNING"
    finally:
        run("scancel", str(job.id), check=False)


# A job listening on one loopback address of its node; ckptuser2 leaves a TIME_WAIT entry on the same port
# number at another address of that node (its own connection), right before the job is requeued.
LISTENING_JOB = r"""
import os, socket, time
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(4)
with open("port.tmp", "w") as f:
    f.write(str(srv.getsockname()[1]))
os.rename("port.tmp", "port")
for i in range(600):
    print(f"tw step {i}", flush=True)
    time.sleep(0.2)
"""
OTHER_TIME_WAIT = r"""
import json, socket, sys
port = int(sys.argv[1])
srv = socket.socket()
srv.bind(("127.0.0.2", port))
srv.listen(1)
client = socket.create_connection(("127.0.0.2", port))
conn, _ = srv.accept()
ends = ["127.0.0.2", port, *client.getsockname()]
conn.close()                 # the accepted end closes first: its TIME_WAIT is at 127.0.0.2:port
client.recv(1)
client.close()
print(json.dumps({"uid": __import__("os").getuid(), "ends": ends}))
"""


def _time_wait(node: str) -> set[tuple[str, int, str, int]]:
    out = set()
    for line in run("ip", "netns", "exec", node, "ss", "-Htan", "state", "time-wait").stdout.splitlines():
        local, remote = line.split()[-2:]
        (la, lp), (ra, rp) = (e.rsplit(":", 1) for e in (local, remote))
        out.add((la.strip("[]").removeprefix("::ffff:"), int(lp), ra.strip("[]").removeprefix("::ffff:"), int(rp)))
    return out


def test_a_restore_frees_its_listening_port_of_its_own_time_wait_only() -> None:
    """Before its restore binds the job's listener again, the agent destroyed every TIME_WAIT entry whose
    local port had that number: ckptuser2's own, at another address of the node, went too. Now only the
    job's own connections (recorded at the capture) are destroyed: ckptuser2's entry survives the restore,
    which does not wait for it (it does not keep the job's address and port)."""
    node = "node1"
    wd = workdir("ckptuser1", "surface-timewait")
    (wd / "listening.py").write_text(LISTENING_JOB)
    job = submit("ckptuser1", wd, f"#!/bin/bash\n{PY} listening.py\n", "-w", node, "--checkpoint-interval=30m")
    try:
        job.wait_output(r"tw step 5\n", timeout=120)
        port = int((wd / "port").read_text())
        script = WORK_ROOT / "ckptuser2" / "surface_timewait.py"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(OTHER_TIME_WAIT)
        script.chmod(0o644)
        theirs = json.loads(run("ip", "netns", "exec", node, "runuser", "-u", "ckptuser2", "--", PY, str(script),
                                str(port)).stdout.strip().splitlines()[-1])
        assert theirs["uid"] == pwd.getpwnam("ckptuser2").pw_uid
        ends = tuple(theirs["ends"])
        t0 = time.monotonic()
        assert ends in _time_wait(node), "ckptuser2 made no TIME_WAIT entry"
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", timeout=120)
        still = ends in _time_wait(node)
        assert time.monotonic() - t0 < 55, "too slow to tell: the entry would have timed out by itself"
        assert still, f"ckptuser2's TIME_WAIT on port {port} was destroyed by the job's restore"
        n = len(re.findall(r"tw step", job.text()))
        job.wait_for(lambda: len(re.findall(r"tw step", job.text())) > n + 3, "the restored job running on", 60)
    finally:
        run("scancel", str(job.id), check=False)


AGENT_LOGS = Path("/var/log/slurmckpt")
FORGED = "2030-01-01 00:00:00,000 slurmckpt.agent job=1 step=batch rank=0 pid=1 INFO FORGED-BY-THE-JOB"


def test_a_program_name_with_a_newline_forges_no_line_in_the_agent_log() -> None:
    """The step's agent logs the program it launched (argv[0]) and its paths: a program whose name holds a
    newline and a whole fake record. The agent's log shows the name escaped on the launch record's line;
    no line of it starts with the fake record (on the old formatter it was a line of its own)."""
    wd = workdir("ckptuser1", "surface-log")
    name = "prog\n" + FORGED
    script = ("#!/bin/bash\n"
              f"name=$(printf {json.dumps(name)})\n"          # printf makes the \\n a newline
              'cp /bin/true "./$name"\n'
              'srun "./$name" && echo step-done\n')
    job = submit("ckptuser1", wd, script, "--checkpoint-interval=30m")
    try:
        assert job.wait_done(timeout=120) == "COMPLETED", job.text()
        assert "step-done" in job.text(), job.text()
        text = "".join(p.read_text(errors="replace") for p in sorted(AGENT_LOGS.glob(f"agent-{job.id}.*.log")))
        assert "FORGED-BY-THE-JOB" in text, "the name never reached the agent log: the test proves nothing"
        forged = [line for line in text.splitlines() if line.startswith("2030-") or "FORGED" in line.split(" ")[0]]
        assert not forged, f"a forged record in the agent log: {forged}"
        assert f"launched ./prog\\n{FORGED}" in text, [l for l in text.splitlines() if "launched" in l]
    finally:
        run("scancel", str(job.id), check=False)
