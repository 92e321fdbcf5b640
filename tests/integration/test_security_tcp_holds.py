"""Attacks by a job's user on the TCP holds of a restore (docs/security.md, "TCP holds between ranks"): a job
whose ranks hold many connections on one node, killed while only some of its ranks are restored, must
leave nothing in the node's packet filter once it has ended, and must not keep another user's capture from
taking criu's own network lock; a job with more connections than a restore may hold is refused at its
capture's check, naming the count and the cap. The node uses nftables here (`network_lock: nftables`), where
each old hold was a base chain of its own and 1024 of them left no room for criu's lock."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.integration.slurmjob import RESTORE_OUTCOME, node, run, site_config, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from ipc_pair import expected_lines  # noqa: E402

ATTACKER, VICTIM = "ckptuser1", "ckptuser2"
NODE = "node2"
CAP = 1024                 # tcp_hold_max's default
NFTABLES = "network_lock: nftables\n"


def attack_script(connections: int) -> str:
    """Four steps of one job on one node: steps 0 and 1 serve, steps 2 and 3 connect to them, `connections`
    in all (criu dumps no tree with much more than 900 open files: libnftables' select() aborts it). Started
    again after a requeue, the script restarts the serving steps at once and the others only ten minutes
    later: the serving steps' restores hold every connection (the other ends are not back) until the other
    ends' would lift them."""
    args = f"--connections {connections // 2}"
    return ("#!/bin/bash\nrm -f port0 port1\n"
            + "".join(f"srun -n1 --overlap python3 tcp_many.py serve {args} --port-file port{i} &\n" for i in (0, 1))
            # steps 0 and 1 serve (the connecting steps start once both listen); a restart runs steps 0 and 1 again
            + 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then sleep 600\n'
            + "else while [ ! -e port0 ] || [ ! -e port1 ]; do sleep 0.2; done; fi\n"
            + "".join(f"srun -n1 --overlap python3 tcp_many.py connect {args} --port-file port{i} &\n" for i in (0, 1))
            + "wait\n")


def in_node(name: str, *cmd: str) -> str:
    """`cmd` in the node's network namespace (one per slurmd on the host cluster; the one-node roots' cluster
    runs in its own)."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return run(*(["ip", "netns", "exec", name] if name in spaces else []), *cmd).stdout


def job_rules(name: str, job: int) -> str:
    """Whatever the node's packet filters hold that names the job (its rules say `slurmckpt job N`; in
    nftables its table is `slurmckpt-N`)."""
    text = in_node(name, "nft", "list", "ruleset") + in_node(name, "iptables-save")
    return "\n".join(line for line in text.splitlines()
                     if f"slurmckpt job {job}\"" in line or f"slurmckpt-{job} " in line)


def criu_tables(name: str) -> set[str]:
    """The tables criu's nftables lock has on the node now (a final dump leaves its own for the restore)."""
    return set(re.findall(r"^table inet (CRIU-\S+)$", in_node(name, "nft", "list", "tables"), re.M))


def hold_chains(name: str) -> int:
    """Base chains on nftables' output hook in slurmckpt's tables (criu's own come and go with its runs)."""
    count, table = 0, ""
    for line in in_node(name, "nft", "list", "ruleset").splitlines():
        if line.startswith("table "):
            table = line.split()[2]
        elif "hook output" in line and table.startswith("slurmckpt"):
            count += 1
    return count


def requeue(job) -> None:
    """The job's user requeues it (Slurm lets a job's owner do that)."""
    run("scontrol", "requeue", str(job.id), user=job.user)


def test_a_job_killed_mid_restore_leaves_no_tcp_hold_and_another_users_capture_still_commits() -> None:
    """ckptuser1's job holds 1024 connections between its steps and is killed while the serving steps are
    restored and the connecting ones are not. Before: those restores made one base chain per connection, so
    criu's own nftables lock found no room (every TCP capture on the node failed, ckptuser2's included), and
    the job's end left every one of them, and the tables criu's final dumps of the connecting steps left.
    Now: one table for the job, lifted by the job's end with criu's; ckptuser2's capture commits."""
    where = node(NODE)
    wd = workdir(ATTACKER, "tcp-holds")
    with site_config(NFTABLES):
        criu_before = criu_tables(where)
        job = submit(ATTACKER, wd, attack_script(CAP), "-n2", "-N1", "-w", where, "--checkpoint-interval=10s")
        job.wait_output(r"committed \(interval\)", timeout=180)
        requeue(job)
        job.wait_output(RESTORE_OUTCOME, 2, timeout=240)       # steps 0 and 1; steps 2 and 3 never come
        assert job_rules(where, job.id), "the restores held nothing: the attack's premise is gone" + \
            job.agent_log_tails(30)
        chains = hold_chains(where)
        run("scancel", str(job.id), user=ATTACKER)
        job.wait_done()
        victim = submit(VICTIM, workdir(VICTIM, "tcp-holds-victim"),
                        "#!/bin/bash\nsrun -n2 python3 ipc_pair.py --mech tcp --steps 150 --sleep 0.2\n",
                        "-n2", "-N1", "-w", where, "--checkpoint-interval=10s")
        victim.wait_output(r"committed \(interval\)", timeout=150)
        job.wait_for(lambda: not job_rules(where, job.id), "the job's end to lift its holds", timeout=60)
        left = criu_tables(where) - criu_before
        assert not left, f"criu's lock tables of the job's final dumps outlived it: {left}"
        assert victim.wait_done() == "COMPLETED"
    for rank in (0, 1):
        assert [l for l in victim.app_lines() if l.startswith(f"r{rank} ")] == expected_lines(rank, 150)
    assert chains == 1, f"the job's holds took {chains} base chains on the output hook"


def test_a_capture_whose_restore_would_hold_more_than_the_cap_is_refused_naming_count_and_cap() -> None:
    """1100 connections between the job's ranks on one node: above tcp_hold_max, the capture is refused at
    its check, naming both, before anything is frozen; the job runs on. Before, it committed, and its
    restores held all 1100."""
    where = node(NODE)
    wd = workdir(ATTACKER, "tcp-holds-cap")
    with site_config(NFTABLES):
        job = submit(ATTACKER, wd, attack_script(1100), "-n2", "-N1", "-w", where, "--checkpoint-interval=10s")
        job.wait_output(r"ABORTED|committed \(interval\)", timeout=180)
        text = job.text()
        assert "committed (interval)" not in text, text[-2000:]
        assert re.search(r"stage check\): .*hold 1100 TCP connections on this node \(1100 between ranks here, 0 "
                         rf"to ranks on other nodes\), above tcp_hold_max \({CAP}\)", text), text[-2000:]
        ticks = job.text().count("connect tick")
        job.wait_for(lambda: job.text().count("connect tick") > ticks + 3, "the job to run on", timeout=30)
        run("scancel", str(job.id), user=ATTACKER)
        job.wait_done()
