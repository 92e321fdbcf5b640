"""The root agent's facts about a job are Slurm's, not text the job's user wrote: its partition, QOS, restart
count, nodes and GPUs (slurm/jobrecord.py, from `squeue --json`), and whether its tree gets a mount namespace
of its own (Slurm's GPUs on the node, never the launch request's environment). The test fails if the attack
works."""
from __future__ import annotations

import json
import os
import pwd
import re
from pathlib import Path

from tests.integration.slurmjob import AGENT_LOGS, Job, run, submit, workdir
from tests.integration.slurmjob import node as slurm_node


def _old_reading(line: str) -> dict:
    """What the agent read from the one-line `scontrol show job -d -o` before slurm/jobrecord.py: the first
    `Key=` anywhere in the line, and every `Nodes=... GRES=...` group (the last one per node won)."""
    first = {k: m.group(1) for k in ("Partition", "QOS", "Restarts") if (m := re.search(rf"(?:^|\s){k}=(\S*)", line))}
    gpus: dict[str, list[int]] = {}
    for nodes, gres in re.findall(r"\bNodes=(\S+)\s+CPU_IDs=\S*\s+Mem=\S*\s+GRES=(\S*)", line):
        idx = [i for m in re.finditer(r"(?:^|,)gpu(?::[^:(,]+)?:\d+\(IDX:([^)]*)\)", gres)
               for part in m.group(1).split(",") for lo, _, hi in [part.partition("-")]
               for i in range(int(lo), int(hi or lo) + 1)]
        gpus[nodes] = sorted(set(idx))
    return {**first, "gpus": gpus}


def _slurms_own(job: int) -> dict:
    """The job as slurmctld holds it, from JSON (22.05's squeue --json lists every job)."""
    jobs = [j for j in json.loads(run("squeue", "--json").stdout)["jobs"] if j["job_id"] == job]
    assert len(jobs) == 1, jobs
    return jobs[0]


def test_job_name_directory_and_output_path_do_not_choose_the_agents_facts() -> None:
    """As ckptuser1: a job named `x Partition=open QOS=free Restarts=7`, run from a directory named `x
    Nodes=<its node> CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)` with an output file named alike, no GPU asked for,
    and a wrapper (sitecustomize on PYTHONPATH) that puts CUDA_VISIBLE_DEVICES=0 into its launch request."""
    node = slurm_node("node1")
    spoof_gres = f"Nodes={node} CPU_IDs=0 Mem=0 GRES=gpu:8(IDX:0-7)"
    wd = workdir("ckptuser1", f"x {spoof_gres}")
    site = workdir("ckptuser1", "facts-site")          # PYTHONPATH splits at the ':' of wd's name
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if sys.argv[0].endswith('slurmckpt-wrap'):\n"
        "    os.environ['CUDA_VISIBLE_DEVICES'] = '0'\n")
    pw = pwd.getpwnam("ckptuser1")
    os.chown(site / "sitecustomize.py", pw.pw_uid, pw.pw_gid)
    out = wd / f"o Partition=open QOS=free Restarts=7 {spoof_gres}.out"
    job: Job = submit("ckptuser1", wd, "#!/bin/bash\necho \"cvd=$CUDA_VISIBLE_DEVICES pid1=$(cat /proc/1/comm)\"\n"
                      "sleep 120\n", "-J", "x Partition=open QOS=free Restarts=7", "-o", str(out), "-w", node,
                      "--checkpoint-interval=30m", f"--export=ALL,PYTHONPATH={site}")
    log_path = AGENT_LOGS / f"agent-{job.id}.batch.0.log"
    job.wait_for(lambda: out.exists() and "pid1=" in out.read_text() and log_path.exists()
                 and " as pid " in log_path.read_text(), "the task launched")
    # precondition: the text form holds the user's words, and the old reading took them
    line = run("scontrol", "show", "job", "-d", "-o", str(job.id)).stdout
    fooled = _old_reading(line)
    assert (fooled["Partition"], fooled["QOS"], fooled["Restarts"]) == ("open", "free", "7"), line
    assert fooled["gpus"][node] == list(range(8)), line
    # Slurm's own answer, and the agent's record of it
    slurm = _slurms_own(job.id)
    assert (slurm["partition"], slurm["restart_cnt"]) != ("open", 7) and not slurm["gres_detail"], slurm
    state = slurm["job_state"] if isinstance(slurm["job_state"], str) else slurm["job_state"][0]
    assert state == "RUNNING", slurm
    log = log_path.read_text()
    record = re.search(r"job instance from Slurm: JobRecord\((.*)\); restart count (\d+);", log)
    assert record, log[-3000:]
    assert f"partition='{slurm['partition']}', qos='{slurm['qos']}'" in record.group(1), record.group(0)
    assert f"restarts={slurm['restart_cnt']}," in record.group(1) and record.group(2) == str(slurm["restart_cnt"])
    assert f"gpus={{'{node}': []}}" in record.group(1) and f"nodes=('{node}',)" in record.group(1), record.group(0)
    # the mount-namespace mode: the launch request said CUDA_VISIBLE_DEVICES=0 (the old rule's input), Slurm
    # allocated no GPU on the node: the tree sees the node's /proc (its PID 1 is the node's, not slurmckpt-init)
    said = re.search(r"cvd=(\S*) pid1=(\S+)", out.read_text())
    assert said and said.group(1) == "0", out.read_text()
    assert said.group(2) == Path("/proc/1/comm").read_text().strip() != "slurmckpt-init", said.group(0)
    assert f"no mount namespace of its own: Slurm allocated GPUs [] on {node};" in log, log[-3000:]
    run("scancel", str(job.id))
