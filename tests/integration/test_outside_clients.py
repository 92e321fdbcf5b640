"""A server job whose clients are outside the job (a client in another node's network namespace, like a
login node or gateway): their connections never block a capture; at the restore they come back closed (the
client sees the connection end and reconnects), the listening socket comes back on its port, and the
sessions the worker keeps in memory survive."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.integration.slurmjob import run, submit, workdir

USER = "ckptuser1"


@pytest.mark.coverage(program="TCP session server with a client on another node", package="python3",
                      launcher="sbatch", nodes=1)
def test_clients_outside_the_job_reconnect_to_the_restored_worker_and_keep_their_sessions() -> None:
    wd = workdir(USER, "outside-clients")
    node = "node1"
    job = submit(USER, wd, "#!/bin/bash\npython3 session_worker.py --steps 300 --sleep 0.2 --port-file port.txt\n",
                 "-w", node, "--checkpoint-interval=10s")
    job.wait_output(r"worker step 3\b", timeout=120)
    port = int((wd / "port.txt").read_text())
    addr = re.search(r"NodeAddr=(\S+)", run("scontrol", "show", "node", node).stdout).group(1)
    client = subprocess.Popen(
        ["ip", "netns", "exec", "node2", "runuser", "-u", "ckptuser2", "--", "python3",
         str(wd / "session_client.py"), "--host", addr, "--port", str(port), "--count", "80", "--sleep", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert client.stdout.readline().strip() == "client connected"
        commits = len(re.findall(r"committed \(interval\)", job.text()))
        job.wait_output(r"committed \(interval\)", count=commits + 1, timeout=120)
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", timeout=240)
        out, _ = client.communicate(timeout=300)
    finally:
        client.kill()
    assert "client PASS count=80" in out, out[-2000:]
    assert re.search(r"reconnects=[1-9]", out), f"the client never saw its connection end: {out[-500:]}"
    assert job.wait_done() == "COMPLETED", job.text()[-2000:]
    steps = [int(m.group(1)) for m in re.finditer(r"^worker step (\d+)$", job.text(), re.M)]
    assert steps == list(range(300)), "the worker restarted or skipped steps"
    assert "TCP connection(s) to another host" not in job.text()
    assert job.restarts() == 1
