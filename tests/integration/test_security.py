"""Privilege model: a malicious wrapper (same uid as the job) talks to the real root agent directly and
cannot make it act outside its own task and job; other users cannot reach a job's images or captures."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import sys
from pathlib import Path

from tests.integration.slurmjob import run, submit, workdir

PY = sys.executable
FAKE_JOB = 990001


def _agent_and_attacker(user: str, job_uid_user: str, attack: str) -> list:
    """Start the real agent for a job owned by `job_uid_user` (as the shim would), then run `attack`
    (python code using `ch`, a slurmckpt Channel to the agent) as `user`, the agent's parent process."""
    job_pw, pw = pwd.getpwnam(job_uid_user), pwd.getpwnam(user)
    for old in Path("/var/lib/slurmckpt/images").glob(f"*/{FAKE_JOB}"):
        shutil.rmtree(old)      # an earlier run's epochs: the attacks choose epoch numbers themselves
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        ours, theirs = socket.socketpair()
        if os.fork() == 0:
            ours.close()
            fd = theirs.detach()
            os.set_inheritable(fd, True)
            os.execv(PY, [PY, "-m", "slurmckpt", "agent", "--fd", str(fd), "--job", str(FAKE_JOB), "--step", "batch",
                          "--rank", "0", "--uid", str(job_pw.pw_uid), "--gid", str(job_pw.pw_gid),
                          "--restart-count", "1"])
        theirs.close()
        fd = ours.detach()
        os.set_inheritable(fd, True)
        os.set_inheritable(w, True)
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
        code = ("import json, os, sys\nfrom slurmckpt.channel import Channel\n"
                f"ch = Channel.from_fd({fd})\nresults = []\n"
                "def attempt(name, op, fds=None, **kw):\n"
                "    try:\n        results.append([name, 'ok', ch.call(op, fds, **kw)])\n"
                "    except Exception as e:\n        results.append([name, type(e).__name__, str(e)])\n"
                + attack + f"\nos.write({w}, json.dumps(results).encode())\n")
        os.execve(PY, [PY, "-c", code], {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PATH": "/usr/bin:/bin"})
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(child, 0)
    return json.loads(out)


def test_malicious_wrapper_cannot_steer_the_agent_outside_its_task() -> None:
    attack = """
attempt("path in epoch", "commit", epoch="../../../etc", ranks={}, reason="x")
attempt("negative epoch", "prepare", epoch=-1)
attempt("capture without a tree", "prepare", epoch=1)
attempt("restore nothing committed", "restore", [0, 1, 2], epoch=1)
attempt("scope traversal", "lookup_coordinator", scope="../../other")
attempt("unknown op", "shell", cmd="id")
attempt("launch without stdio", "launch", argv=["id"], env={}, cwd="/")
r, w = os.pipe()
attempt("launch", "launch", [0, w, w], argv=["id", "-u"], env={"PATH": "/usr/bin:/bin"}, cwd="/tmp")
os.close(w)
pid = results[-1][2].get("pid") if results[-1][1] == "ok" else None
results.append(["tree uid output", "ok", os.read(r, 100).decode().strip()])
attempt("second launch", "launch", [0, 1, 2], argv=["true"], env={}, cwd="/")
"""
    results = {name: (kind, detail) for name, kind, detail in
               _agent_and_attacker("ckptuser1", "ckptuser1", attack)}
    assert results["path in epoch"][0] == "ProtocolError"
    assert results["negative epoch"][0] == "ProtocolError"
    assert results["capture without a tree"][0] == "TaskEnded"       # a CaptureError: no tree runs here
    assert results["restore nothing committed"][0] == "StorageError"
    assert results["scope traversal"][0] == "ProtocolError"
    assert results["unknown op"][0] == "ProtocolError"
    assert results["launch without stdio"][0] == "ProtocolError"
    assert results["launch"][0] == "ok"
    assert results["tree uid output"][1] == str(pwd.getpwnam("ckptuser1").pw_uid), "tree must run as the job user"
    assert results["second launch"][0] == "PermissionDenied"


def test_agent_refuses_a_wrapper_running_as_another_user() -> None:
    attack = 'attempt("launch", "launch", [0, 1, 2], argv=["true"], env={}, cwd="/")'
    results = _agent_and_attacker("ckptuser2", "ckptuser1", attack)
    assert results[0][1] == "PermissionDenied", results


def test_other_users_cannot_read_images_or_capture_a_foreign_job() -> None:
    wd = workdir("ckptuser1", "foreign")
    job = submit("ckptuser1", wd, "#!/bin/bash\nsleep 60\n", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)", timeout=120)
    p = run("ls", "/var/lib/slurmckpt/images", user="ckptuser2", check=False)
    assert p.returncode != 0, "the image store is readable by a user"
    p = run("/opt/slurmckpt/venv/bin/slurmckpt", "checkpoint", str(job.id), user="ckptuser2", check=False)
    assert p.returncode != 0 and "refused" in p.stderr + p.stdout
    p = run("/opt/slurmckpt/venv/bin/slurmckpt", "list", user="ckptuser2", check=False)
    assert p.returncode != 0 and "root" in p.stderr
    run("scancel", str(job.id))
