"""A real job on the real cluster is captured, requeued and restored mid-run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.integration.slurmjob import job_field, run, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

USER = "ckptuser1"
PREAMBLE = 'echo "preamble $(date +%s.%N)" >> preamble.log\necho "preamble"\n'


def data_lines(steps: int) -> list[str]:
    return [" ".join(l.split()[2:5:2]) for l in expected_lines("x", steps)[:-1]]


def test_requeue_twice_resumes_mid_run_with_exact_output() -> None:
    """(a) counter, RNG stream, appended file, child process, loopback TCP pair, stdout; two requeues."""
    wd = workdir(USER, "requeue")
    job = submit(USER, wd, "#!/bin/bash\n" + PREAMBLE +
                 "python3 zdtm.py --steps 300 --sleep 0.2 --tag main --data data.txt\necho epilogue\n",
                 "--checkpoint-interval=15s")
    job.wait_output(r"committed \(interval\)")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 1)
    job.wait_output(r"committed \(interval\)", 2)
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == ["preamble", *expected_lines("main", 300), "epilogue"]
    assert len((wd / "preamble.log").read_text().splitlines()) == 1, "the batch preamble ran again"
    assert (wd / "data.txt").read_text().splitlines() == data_lines(300)
    assert job.restarts() == 2
    restored_at = [int(l.split()[2]) for l in job.text().splitlines() if l.startswith("main step")]
    assert restored_at == list(range(300)), "the counter restarted or skipped"


def test_preemption_captures_within_gracetime_and_resumes() -> None:
    """(b) a high-priority job preempts it (PreemptMode=REQUEUE); --open-mode=append this time."""
    wd = workdir(USER, "preempt")
    low = submit(USER, wd, "#!/bin/bash\n" + PREAMBLE +
                 "python3 zdtm.py --steps 600 --sleep 0.2 --tag low --data data.txt\n",
                 "-p", "low", "-w", "node1", "-n2", "--open-mode=append", "--checkpoint-interval=10m")
    low.wait_output(r"low step 20 ")
    high = submit("ckptuser2", workdir("ckptuser2", "preempt-high"), "#!/bin/bash\nsleep 5\necho high done\n",
                  "-p", "high", "-w", "node1", "-n2")
    low.wait_output(r"(?:committed|captured) \(sigterm\)", timeout=120)
    assert high.wait_done() == "COMPLETED"
    low.wait_output(r"restored from checkpoint epoch")
    assert low.wait_done() == "COMPLETED"
    assert low.app_lines() == ["preamble", *expected_lines("low", 600)]
    assert low.restarts() >= 1
    assert len((wd / "preamble.log").read_text().splitlines()) == 1


def test_walltime_capture_and_requeue_without_user_signal() -> None:
    """(c) --time=2 with more work than fits: captured before EndTime, requeued, finished correctly."""
    wd = workdir(USER, "walltime")
    job = submit(USER, wd, "#!/bin/bash\n" + PREAMBLE +
                 "python3 zdtm.py --steps 650 --sleep 0.2 --tag wall --data data.txt\n",
                 "--time=2", "--checkpoint-interval=30m")
    job.wait_output(r"(?:committed|captured) \(walltime\)", timeout=200)
    assert job.wait_done(timeout=500) == "COMPLETED"
    assert job.app_lines() == ["preamble", *expected_lines("wall", 650)]
    assert job.restarts() >= 1


def test_srun_step_ranks_restore_and_exit_codes_reach_sacct() -> None:
    """(d) `srun -n2` step: both ranks restored, output continues, the step's exit code reaches sacct."""
    wd = workdir(USER, "steps")
    job = submit(USER, wd, "#!/bin/bash\n" + PREAMBLE +
                 "srun -n2 python3 zdtm.py --steps 150 --sleep 0.2 --data data.$$ --exit 3\n"
                 "echo \"epilogue rc=$?\"\n",
                 "-n2", "--checkpoint-interval=15s")
    job.wait_output(r"committed \(interval\)")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2)
    assert job.wait_done() == "COMPLETED"
    lines = job.app_lines()
    for rank in ("r0", "r1"):
        assert [l for l in lines if l.startswith(rank + " ")] == expected_lines(rank, 150)
    assert lines[0] == "preamble" and lines.count("preamble") == 1
    assert lines[-1] == "epilogue rc=3"
    assert job.sacct()[f"{job.id}.0"] == ("FAILED", "3:0")


def test_bad_interval_values_are_rejected_at_submission() -> None:
    """(e) the message names the option and the bad value; nothing is queued."""
    wd = workdir(USER, "badvalues")
    for value in ("abc", "5s", "1:75", "-3", "10x"):
        for cmd in (["sbatch", f"--checkpoint-interval={value}", "--wrap", "true"],
                    ["srun", f"--checkpoint-interval={value}", "true"]):
            p = run(*cmd, user=USER, check=False, cwd=wd)
            assert p.returncode != 0, f"{cmd} was accepted"
            assert "--checkpoint-interval" in p.stderr and value in p.stderr, p.stderr
    p = run("srun", "--checkpoint-interval=off", "bash", "-c", "echo $SLURMCKPT_INTERVAL; cat /proc/$$/cmdline",
            user=USER, cwd=wd)
    assert "slurmckpt" not in p.stdout, "a job with the option off must run exactly as without the plugin"
    p = run("srun", "--checkpoint-interval=1m", "bash", "-c", "echo $SLURMCKPT_INTERVAL", user=USER, cwd=wd)
    assert p.stdout.strip() == "", "slurmckpt's own variables leaked into the workload"


def test_failed_capture_keeps_job_running_and_previous_checkpoint() -> None:
    """(f) CRIU fails (the workload opens a userfaultfd, which CRIU cannot dump): the epoch aborts, the
    job runs on to a correct end, and the epoch committed before the failure stays intact."""
    from slurmckpt.config import Config
    from slurmckpt.store.jobstore import JobStore, list_jobs
    wd = workdir(USER, "capturefail")
    job = submit(USER, wd, "#!/bin/bash\n" + PREAMBLE +
                 "python3 zdtm.py --steps 200 --sleep 0.2 --tag f --data data.txt --poison-at 90\n",
                 "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)")
    job.wait_output(r"ABORTED \(rank batch\.0, node [^,]+, stage dump\): ", timeout=120)
    # while it runs on (its images go at its end)
    root = Path(Config.load().storage_root)
    cluster = next(c for c, j in list_jobs(root) if j == job.id)
    store = JobStore(root, cluster, job.id)
    epochs = store.committed()
    assert epochs, "the checkpoint committed before the failure is gone"
    manifest = store.verify_rank(epochs[0]["epoch"], "batch", 0)
    assert manifest.capture.tree.kind == "image"
    listed = json.loads(run("/opt/slurmckpt/venv/bin/slurmckpt", "list", "--json").stdout)
    assert any(r["job"] == job.id for r in listed)
    assert job.state() == "RUNNING"
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == ["preamble", *expected_lines("f", 200)]


def test_batch_script_restored_on_another_node_continues_where_it_was() -> None:
    """The batch shell reads its script from the node's spool directory: restored on another node, it
    reads the new start's copy from the same position (the preamble does not run again, the epilogue
    runs once)."""
    wd = workdir(USER, "elsewhere")
    job = submit(USER, wd, "#!/bin/bash\n" + PREAMBLE +
                 "python3 zdtm.py --steps 150 --sleep 0.2 --tag main --data data.txt\necho epilogue\n",
                 "-w", "node1", "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)")
    run("scontrol", "requeuehold", str(job.id))
    job.wait_for(lambda: job.state() == "PENDING", "the requeue-hold", 120)
    run("scontrol", "update", f"JobId={job.id}", "NumNodes=1", "ReqNodeList=node2")
    run("scontrol", "release", str(job.id))
    job.wait_output(r"restored from checkpoint epoch")
    assert job_field(job.id, "NodeList") == "node2"
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == ["preamble", *expected_lines("main", 150), "epilogue"]
    assert len((wd / "preamble.log").read_text().splitlines()) == 1, "the batch preamble ran again"
