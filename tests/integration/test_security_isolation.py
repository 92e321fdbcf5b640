"""A job's user (or another user) cannot steer what the root side restores or refuses: images are bound to
the job instance that wrote them, GPU identities come from Slurm, and another user's connection to a job's
listening port does not keep it from being checkpointed. Every test fails if its attack works."""
from __future__ import annotations

import glob
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.integration.slurmjob import job_field, run, site_keys, submit, workdir
from tests.integration.slurmjob import node as slurm_node

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from listener import expected_lines as listener_lines  # noqa: E402
from zdtm import expected_lines  # noqa: E402

STORE = Path("/var/lib/slurmckpt/images")
LOGS = Path("/var/log/slurmckpt")


def _store_of(job: int) -> Path:
    found = [Path(p) for p in glob.glob(f"{STORE}/*/{job}")]
    assert len(found) == 1, f"store of job {job}: {found}"
    return found[0]


def _finished_job_with_images(user: str, tag: str):
    """A job of `user` that committed a checkpoint and completed: its images stay in the store
    (`keep_finished`, which its end obeys as gc does). It runs ~30 s, three of its 10 s intervals: at 12 s
    (60 steps) a slow start on CI left no interval inside it and the job completed without a commit."""
    wd = workdir(user, f"iso-{tag}")
    with site_keys(keep_finished=True):
        job = submit(user, wd, f"#!/bin/bash\npython3 zdtm.py --steps 150 --sleep 0.2 --tag {tag} --data d.txt\n",
                     "--checkpoint-interval=10s")
        job.wait_output(r"committed \(interval\)", timeout=240)
        assert job.wait_done() == "COMPLETED"
        end_log = LOGS / f"agent-{job.id}.end.0.log"
        job.wait_for(lambda: "keep_finished is set" in (end_log.read_text() if end_log.exists() else ""),
                     "the job's end keeping its images (keep_finished)", 60)
    store = _store_of(job.id)
    assert json.loads((store / "manifest.json").read_text())["epochs"], "the old job left no committed epoch"
    return job, store


def _replace_store(target: Path, source: Path, rebind: dict | None = None) -> None:
    """As root: put `source`'s images where `target`'s job looks (what a reused job id finds)."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, symlinks=True)
    if rebind is not None:
        manifest = json.loads((target / "manifest.json").read_text())
        manifest["instance"].update(rebind)
        (target / "manifest.json").write_text(json.dumps(manifest))


def test_images_of_another_job_instance_with_the_same_id_are_never_restored() -> None:
    old, old_store = _finished_job_with_images("ckptuser1", "oldjob")
    wd = workdir("ckptuser2", "iso-newjob")
    new = submit("ckptuser2", wd, "#!/bin/bash\npython3 zdtm.py --steps 150 --sleep 0.2 --tag newjob --data d.txt\n",
                 "--checkpoint-interval=30m")
    new.wait_output(r"newjob step 10 ", timeout=240)
    _replace_store(_store_of(new.id), old_store)          # the old job's images under the new job's id
    new.requeue()
    new.wait_output(r"slurmckpt.*not this job's", timeout=240)
    # moved aside, kept for the admins until the job's own images go (at its end)
    assert any(Path(p).is_dir() for p in glob.glob(f"{STORE}/*/.stale-{new.id}-*")), "stale images not kept aside"
    assert new.wait_done() == "COMPLETED"
    text = new.text()
    assert "oldjob" not in text, "the new job restored the old job's images:\n" + text
    assert f"another job instance (uid {pwd.getpwnam('ckptuser1').pw_uid}," in text, text
    assert new.app_lines() == expected_lines("newjob", 150), text
    assert "restored from checkpoint epoch" in text, "the new job's own capture was not kept:\n" + text
    assert new.restarts() == 1


def test_a_job_that_was_never_requeued_restores_nothing_whatever_the_store_holds() -> None:
    old, old_store = _finished_job_with_images("ckptuser1", "fresh-old")
    wd = workdir("ckptuser1", "iso-fresh")
    job = submit("ckptuser1", wd, "#!/bin/bash\npython3 zdtm.py --steps 40 --sleep 0.2 --tag fresh --data d.txt\n",
                 "--checkpoint-interval=30m", "--hold")
    submitted = job_field(job.id, "SubmitTime")
    cluster = old_store.parent
    # images bound exactly to this job (its id, uid, gid, SubmitTime), committed before it ever ran
    _replace_store(cluster / str(job.id), old_store, rebind={"job": job.id, "submit_time": submitted})
    run("scontrol", "release", str(job.id), user="ckptuser1")
    assert job.wait_done() == "COMPLETED"
    text = job.text()
    assert job_field(job.id, "SubmitTime") == submitted, "release changed SubmitTime: the binding did not match"
    assert "restored from checkpoint" not in text and "fresh-old" not in text, text
    assert job.app_lines() == expected_lines("fresh", 40), text


def test_cuda_visible_devices_of_the_wrapper_does_not_choose_the_gpus_of_a_restore() -> None:
    """The job's user controls its wrapper: a sitecustomize on PYTHONPATH re-execs it (same pid) with
    CUDA_VISIBLE_DEVICES=1 while Slurm allocated GPU 0. The agent must use Slurm's allocation."""
    wd = workdir("ckptuser1", "iso-gpu")
    (wd / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if sys.argv[0].endswith('slurmckpt-wrap') and os.environ.get('CUDA_VISIBLE_DEVICES') != '1':\n"
        "    os.environ['CUDA_VISIBLE_DEVICES'] = '1'\n"
        "    os.execv(sys.executable, [sys.executable, *sys.argv])\n")
    pw = pwd.getpwnam("ckptuser1")
    os.chown(wd / "sitecustomize.py", pw.pw_uid, pw.pw_gid)
    job = submit("ckptuser1", wd, "#!/bin/bash\necho \"gpus=$CUDA_VISIBLE_DEVICES\"\n"
                 "python3 zdtm.py --steps 120 --sleep 0.2 --tag gspoof --data d.txt\n",
                 "--gres=gpu:1", "--checkpoint-interval=10s", f"--export=ALL,PYTHONPATH={wd}")
    job.wait_output(r"committed \(interval\)")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch")
    assert job.wait_done() == "COMPLETED"
    node = job_field(job.id, "NodeList")
    log = (LOGS / f"agent-{job.id}.batch.0.log").read_text()
    lines = [l for l in log.splitlines() if "GPUs for restore from Slurm's allocation" in l]
    assert lines, log[-3000:]
    # the attack reached the wrapper (the old code read exactly this value) ...
    assert "CUDA_VISIBLE_DEVICES '1' not used" in lines[-1], lines
    # ... and the agent used what Slurm allocated on that node
    allocated = re.search(rf"allocation on {node}: \[(\d+)\]; used: \[(\d+)\] ", lines[-1])
    assert allocated and allocated.group(1) == allocated.group(2), lines[-1]
    assert job.app_lines()[1:] == expected_lines("gspoof", 120)


def test_another_users_connection_to_a_listening_port_does_not_block_captures() -> None:
    wd = workdir("ckptuser1", "iso-listen")
    node = slurm_node("node3")
    job = submit("ckptuser1", wd, "#!/bin/bash\npython3 listener.py --steps 200 --sleep 0.2 --port-file port.txt\n",
                 "-w", node, "--checkpoint-interval=10s")
    job.wait_output(r"tcp step 3 ")
    port = int((wd / "port.txt").read_text())
    addr = re.search(r"NodeAddr=(\S+)", run("scontrol", "show", "node", node).stdout).group(1)
    holder = subprocess.Popen(
        ["runuser", "-u", "ckptuser2", "--", "python3", "-c",
         "import socket, sys, time\n"
         f"s = socket.create_connection(('{addr}', {port}))\n"
         "print('connected', flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "connected"
        commits = len(re.findall(r"committed \(interval\)", job.text()))
        job.wait_output(r"committed \(interval\)", count=commits + 1, timeout=120)
        assert "TCP connection(s) to another host" not in job.text(), job.text()
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", timeout=240)
        assert job.wait_done() == "COMPLETED"
    finally:
        holder.kill()
        holder.wait()
    assert job.app_lines() == listener_lines(200), job.text()
    assert job.restarts() == 1
