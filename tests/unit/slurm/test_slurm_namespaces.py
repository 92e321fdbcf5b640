"""namespace/linux's per-job user and PID namespaces (slurm/namespaces.py): a task in either is refused at its
agent's start, naming the setting, so its wrapper runs it plainly and nothing is ever frozen; a task in the
node's namespaces (a host, a container, slurmckpt's test roots) is not."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from slurmckpt.node import procfs
from slurmckpt.policy import JobPolicy
from slurmckpt.slurm.namespaces import INIT_USER_NS, job_namespace_refusal

WRAPPER = 20


def _proc(root: Path, pid: int, nspid: str, user_ns: int, argv: list[str], ppid: int = 1) -> None:
    d = root / str(pid)
    (d / "ns").mkdir(parents=True)
    (d / "status").write_text(f"Name:\tx\nPPid:\t{ppid}\nNSpid:\t{nspid}\n")
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    (d / "ns" / "user").symlink_to(f"user:[{user_ns}]")


def _node(tmp_path: Path, nspid: str = "20", user_ns: int = INIT_USER_NS,
          init: tuple[str, ...] = ("/sbin/init",), ppid: int = 12) -> Path:
    root = tmp_path / "proc"
    _proc(root, 1, "1", INIT_USER_NS, list(init))
    _proc(root, WRAPPER, nspid, user_ns, ["/usr/local/bin/slurmckpt-wrap", "python3", "x.py"], ppid)
    return root


def test_a_task_in_the_nodes_namespaces_is_checkpointed(tmp_path: Path) -> None:
    with procfs.rooted(_node(tmp_path)):
        assert job_namespace_refusal(WRAPPER) is None


@pytest.mark.parametrize("node, flags", [
    (dict(user_ns=4026532999), "CLONE_NEWUSER"),
    (dict(nspid="20 3"), "CLONE_NEWPID"),                    # /proc shows the node's PID namespace
    (dict(nspid="20", ppid=0), "CLONE_NEWPID"),              # slurmstepd outside the task's
    (dict(init=("slurmstepd: [7:namespace]",)), "CLONE_NEWPID"),   # /proc is the job's (seen on 26.05)
    (dict(user_ns=4026532999, nspid="20 3"), "CLONE_NEWUSER, CLONE_NEWPID"),
])
def test_a_task_in_its_jobs_own_namespace_is_refused_naming_the_setting(tmp_path: Path, node: dict,
                                                                        flags: str) -> None:
    with procfs.rooted(_node(tmp_path, **node)):
        why = job_namespace_refusal(WRAPPER)
    assert why and f"NamespaceType=namespace/linux with clone_ns_flags {flags} in namespace.yaml" in why, why


def test_the_refusal_disables_every_capture_with_its_own_words() -> None:
    """The policy the agent serves: no interval, every capture refused with the namespace's reason (the
    wrapper's plan says `disabled` and it runs the task plainly)."""
    policy = JobPolicy().refused_by("NamespaceType=namespace/linux", "the job runs in a PID namespace of its own")
    assert policy.interval(600, True) == 0
    assert policy.capture_refusal(final=True, since_last_s=None) == (
        "NamespaceType=namespace/linux", "the job runs in a PID namespace of its own")
    assert JobPolicy(allowed=False, denied_by="partition debug").capture_refusal(True, None)[1] == \
        "checkpoints are not allowed in partition debug (site policy)"


def test_real_user_and_pid_namespaces_are_seen_from_the_nodes_proc() -> None:
    """The same checks on real processes: one in the node's namespaces, one that unshare put in a user and
    a PID namespace of its own (as namespace/linux's clone does)."""
    assert job_namespace_refusal(os.getpid()) is None
    child = subprocess.Popen(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
                              "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while not (inner := [p for p in procfs.pids() if procfs.stat(p).ppid == child.pid]):
            assert time.monotonic() < deadline, "unshare started no child"
            time.sleep(0.05)
        why = job_namespace_refusal(inner[0])
        assert why and "clone_ns_flags CLONE_NEWUSER, CLONE_NEWPID" in why, why
    finally:
        child.kill()
        child.wait()
