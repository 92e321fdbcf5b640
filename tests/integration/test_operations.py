"""Operations on the real cluster (docs/operations.md): the event lines in slurmd's log (through the plugin's
relay), the last checkpoint in the job's AdminComment, the metrics file as node_exporter reads it, what a job's
user sees of its checkpoints and what another user does not, the CLI like Slurm's tools (unknown jobs, requeue,
migrate, jobs enabled by default_interval=, doctor on the real plugstack chain), and the site policy at sbatch
(cli_filter.lua) and in the agents."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.slurmjob import Job, job_field, plugin_args, run, site_config, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
USER, OTHER = "ckptuser1", "ckptuser2"
LOGS = Path("/var/lib/slurmckpt-cluster/log")
TEXTFILES = Path("/var/lib/prometheus/node-exporter")
SUMMARIES = Path("/var/lib/slurmckpt/summaries")


def slurmd_lines(node: str, job: Job, event: str, timeout: float = 60) -> list[str]:
    """slurmd's log lines of `node` the job's agents relayed for `event`, once there is one."""
    pattern = re.compile(rf"\[{job.id}\.\w+\] (?:error: )?slurmckpt: job={job.id} rank=\S+ node=\S+ event={event} ")
    deadline = time.monotonic() + timeout
    while True:
        lines = [l for l in (LOGS / f"slurmd.{node}.log").read_text(errors="replace").splitlines() if pattern.search(l)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(1)


def zdtm_job(name: str, steps: int, *options: str) -> Job:
    wd = workdir(USER, name)
    return submit(USER, wd, f"#!/bin/bash\npython3 zdtm.py --steps {steps} --sleep 0.2 --tag {name} --data d.txt\n",
                  *options)


def scrape_node_exporter() -> str:
    """What node_exporter's textfile collector serves from slurmckpt's files (a private instance on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = subprocess.Popen(["prometheus-node-exporter", "--collector.disable-defaults", "--collector.textfile",
                                 f"--collector.textfile.directory={TEXTFILES}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                assert exporter.poll() is None and time.monotonic() < deadline, exporter.stderr.read().decode()
                time.sleep(0.3)
    finally:
        exporter.terminate()
        exporter.wait(10)


def test_events_reach_slurmds_log_the_comment_the_metrics_and_the_users_summary() -> None:
    job = zdtm_job("ops-events", 200, "-w", "node1", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)")
    commits = slurmd_lines("node1", job, "commit")
    assert commits, "no commit line in slurmd.node1.log"
    m = re.search(rf"\[{job.id}\.batch\] slurmckpt: job={job.id} rank=batch\.0 node=node1 event=commit epoch=(\d+) "
                  r"trigger=interval final=false ranks=1 nodes=node1 bytes=(\d+)$", commits[0])
    assert m and int(m.group(2)) > 0, commits[0]
    job.wait_for(lambda: re.search(r"AdminComment=slurmckpt: last checkpoint: epoch \d+ at \d{4}-\d\d-\d\dT[\d:]{8}, "
                                   r"[\d.]+ (KiB|MiB|GiB) *\n", run("scontrol", "show", "job", str(job.id)).stdout)
                 is not None, "the last checkpoint in AdminComment", timeout=90)

    # the job's user reads its summary; another user neither the summary nor the images
    summary = SUMMARIES / "slurmckpt" / f"{job.id}.json"
    st = summary.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o440)      # root's; its user reads it through an ACL
    mine = run(CLI, "status", str(job.id), user=USER).stdout
    assert re.search(r"newest checkpoint: epoch \d+ \(interval\)", mine), mine
    theirs = run(CLI, "status", str(job.id), user=OTHER).stdout
    assert "no checkpoint summary visible" in theirs and "newest checkpoint" not in theirs, theirs
    assert run("cat", str(summary), user=OTHER, check=False).returncode != 0

    scraped = scrape_node_exporter()
    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    errors = [s for s in families["node_textfile_scrape_error"].samples]
    assert errors and all(s.value == 0 for s in errors), scraped[:2000]
    commits_total = [s for s in families["slurmckpt_commits"].samples if s.labels.get("trigger") == "interval"]
    assert commits_total and commits_total[0].value >= 1
    assert families["slurmckpt_stall_seconds"].type == "histogram"

    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    node = job_field(job.id, "BatchHost") or "node1"
    restores = slurmd_lines(node, job, "restore")
    assert restores and re.search(r"event=restore epoch=\d+ seconds=[\d.]+$", restores[-1]), restores
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("ops-events", 200)
    listed = json.loads(run(CLI, "status", "--json", str(job.id), user=USER).stdout)
    assert listed[0]["restarts"] in (1, None) and listed[0]["epoch"] is not None, listed


def test_unknown_jobs_fail_like_squeue_and_at_once() -> None:
    assert run("squeue", "-j", "999999", check=False).returncode == 1
    for command in (["status", "999999"], ["checkpoint", "999999"], ["requeue", "999999"],
                    ["migrate", "999999", "--to", "node2"]):
        start = time.monotonic()
        p = run(CLI, *command, user=USER, check=False)
        assert time.monotonic() - start < 5, command
        assert p.returncode == 1 and p.stderr == "slurmckpt: error: Invalid job id specified: 999999\n", p.stderr


def test_requeue_captures_requeues_and_the_job_resumes() -> None:
    job = zdtm_job("ops-requeue", 100, "--checkpoint-interval=30m")
    job.wait_output(r"ops-requeue step 10 ")
    out = run(CLI, "requeue", "--parsable", "--noheader", str(job.id), user=USER).stdout
    assert out == f"{job.id}\n"
    job.wait_output(r"(?:committed|captured) \(manual-requeue\)", timeout=90)
    job.wait_output(r"restored from checkpoint epoch", timeout=240)
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("ops-requeue", 100) and job.restarts() == 1


def test_migrate_moves_a_running_job_to_another_node_and_restores_it_there() -> None:
    job = zdtm_job("ops-migrate", 150, "-w", "node1", "--checkpoint-interval=30m")
    job.wait_output(r"ops-migrate step 10 ")
    p = run(CLI, "migrate", str(job.id), "--to", "node2", "--json", user=USER, timeout=600)
    doc = json.loads(p.stdout)
    assert doc["action"] == "migrate" and doc["detail"].startswith("running on node2"), doc
    job.wait_output(r"restored from checkpoint epoch", timeout=120)
    assert slurmd_lines("node2", job, "restore"), "no restore line in slurmd.node2.log"
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("ops-migrate", 150)
    assert job_field(job.id, "NodeList") == "node2"


def test_checkpoint_accepts_a_job_enabled_by_the_plugins_default_interval() -> None:
    with plugin_args("default_interval=30m"):
        job = zdtm_job("ops-default", 300)           # no --checkpoint-interval of its own
        try:
            job.wait_output(r"ops-default step 5 ")
            run(CLI, "checkpoint", str(job.id), user=USER)
            job.wait_output(r"committed \(manual\)", timeout=90)
        finally:
            run("scancel", str(job.id), check=False)


POLICY = "policy:\n  partitions:\n    high: {allowed: false}\n    low: {min_interval: 1m}\n"


def test_the_site_policy_refuses_at_sbatch_naming_the_option() -> None:
    wd = workdir(USER, "ops-policy-sbatch")
    (wd / "min.sh").write_text("#!/bin/bash\n#SBATCH -p low\n#SBATCH --checkpoint-interval=30s\ntrue\n")
    with site_config(POLICY):
        cases = [(["-p", "high", "--checkpoint-interval=10m", "--wrap", "true"],
                  "slurmckpt: --checkpoint-interval=10m: checkpoints are not allowed in partition high (site policy)"),
                 (["-p", "low", "--checkpoint-interval=30s", "--wrap", "true"],
                  "slurmckpt: --checkpoint-interval=30s: below the minimum 1m of partition low (site policy)"),
                 (["min.sh"], "below the minimum 1m of partition low")]
        for args, message in cases:
            p = run("sbatch", *args, user=USER, cwd=wd, check=False)
            assert p.returncode != 0 and message in p.stderr, (args, p.stderr)
        held = [run("sbatch", "--parsable", "--hold", *args, "--wrap", "true", user=USER, cwd=wd).stdout.strip()
                for args in (["-p", "low", "--checkpoint-interval=2m"], ["-p", "high"])]
    for job in held:
        run("scancel", job.split(";")[0], check=False)


def test_a_job_whose_partition_forbids_checkpoints_runs_without_them() -> None:
    job = zdtm_job("ops-forbidden", 40, "--begin=now+10", "-w", "node1", "--checkpoint-interval=10s")
    with site_config("policy:\n  partitions:\n    debug: {allowed: false}\n"):
        job.wait_output(r"checkpoints are not allowed in partition debug \(site policy\): running the task without "
                        r"checkpoints", timeout=120)
        assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("ops-forbidden", 40)
    assert "committed" not in job.text()
    refused = slurmd_lines("node1", job, "policy-refused")
    assert refused and "error: slurmckpt:" in refused[0] and "rule=\"partition debug\"" in refused[0], refused


def test_periodic_captures_closer_than_the_minimum_interval_are_refused_by_the_agent() -> None:
    job = zdtm_job("ops-minimum", 600, "--begin=now+10", "--checkpoint-interval=10s")
    try:
        with site_config("policy:\n  default: {min_interval: 2m}\n"):
            job.wait_output(r"checkpoint interval 120s, set by the site policy \(the site default\)", timeout=120)
            job.wait_output(r"ops-minimum step 5 ")
        run(CLI, "checkpoint", str(job.id), user=USER)
        job.wait_output(r"committed \(manual\)", timeout=90)
        run(CLI, "checkpoint", str(job.id), user=USER)
        job.wait_output(r"ABORTED \(rank [^,]+, node [^,]+, stage prepare\): .*below the minimum interval 2m of the site default", timeout=90)
        assert job.state() == "RUNNING"
    finally:
        run("scancel", str(job.id), check=False)


def test_doctor_follows_plugstackconfig_and_its_includes(tmp_path: Path) -> None:
    conf = Path("/etc/slurm/slurm.conf").read_text()
    line = next(l for l in Path("/etc/slurm/plugstack.conf").read_text().splitlines() if "slurmckpt_spank.so" in l)
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "50-slurmckpt.conf").write_text(line + "\n")
    (tmp_path / "stack.conf").write_text("include conf.d/*.conf\n")
    (tmp_path / "slurm.conf").write_text(re.sub(r"(?m)^PlugStackConfig=.*$", f"PlugStackConfig={tmp_path}/stack.conf",
                                                conf))
    p = subprocess.run([CLI, "doctor", "--json"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")})
    checks = {c["check"]: c for c in json.loads(p.stdout)["checks"]}
    assert checks["plugstack.conf line"]["result"] == "ok", checks
    assert checks["plugstack.conf line"]["detail"].startswith(f"{tmp_path}/conf.d/50-slurmckpt.conf:1: required ")
    assert checks["plugstack chain"]["detail"] == f"{tmp_path}/stack.conf -> {tmp_path}/conf.d/50-slurmckpt.conf"
