"""docker-slurm/: the container test cluster is built from a debootstrap'ed Debian 12 base, started with
compose, and the demo job in it (sbatch --checkpoint-interval) is requeued onto the other compute node and
restored there mid-run, with the job's output exactly that of an uninterrupted run; its daemons run as
hardened as CRIU allows.

Runs docker-slurm/cluster.sh as a user would (Docker when its daemon answers, else podman as root through
its Docker API and docker-compose). A missing engine or tool is a failure, never a skip."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "docker-slurm" / "cluster.sh"
sys.path.insert(0, str(REPO / "tests" / "integration" / "workloads"))
from zdtm import expected_lines  # noqa: E402

DEMO_DIR = "/var/tmp/slurmckpt-work/ckptuser1/demo"
STEPS = 120                      # scripts/demo.sh runs zdtm.py --steps 120 --tag demo


def cluster(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)


def must(*args: str, timeout: float) -> str:
    t0 = time.monotonic()
    r = cluster(*args, timeout=timeout)
    print(f"docker-slurm/cluster.sh {' '.join(args)}: rc={r.returncode} in {time.monotonic() - t0:.0f} s")
    assert r.returncode == 0, f"cluster.sh {' '.join(args)} failed (rc={r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def docker_cluster():
    cluster("down", timeout=180)                 # what an interrupted earlier run left behind
    must("build", timeout=1200)
    try:
        must("up", timeout=300)
        yield
    finally:
        logs = cluster("logs", timeout=60)
        print(logs.stdout[-6000:])
        must("down", timeout=180)


def test_demo_job_is_restored_mid_run_on_the_other_node(docker_cluster) -> None:
    """The demo job is captured on the node it ran on, that node is drained, `scontrol requeue` restarts it
    on the other node, which restores it from the shared image store: every step printed exactly once, the
    batch script's preamble once, the restore between the first and the last step, the job COMPLETED."""
    demo = must("demo", timeout=600)
    job = re.search(r"^job (\d+) submitted", demo, re.M).group(1)
    first = re.search(r"job \d+ runs on (c[12]):", demo).group(1)
    then = re.search(r"^running on (c[12]) now", demo, re.M).group(1)
    assert {first, then} == {"c1", "c2"}, demo
    assert re.search(rf"batch\.0: image on {first}\b", demo), demo       # slurmckpt inspect, after the move

    out = must("exec", "slurmctld", "cat", f"{DEMO_DIR}/slurm-{job}.out", timeout=60).splitlines()
    app = [line for line in out if line.startswith("demo ")]
    assert app == expected_lines("demo", STEPS)
    assert [line for line in out if line.startswith("preamble:")] == \
        [f"preamble: job {job} started on {first} (restart count 0)"]
    restored = [i for i, line in enumerate(out) if re.match(r"slurmckpt\[.*\]: restored from checkpoint epoch \d+ "
                                                             r".*\(restart 1\)(: .*)?$", line)]
    assert len(restored) == 1, out
    steps_before = sum(line.startswith("demo step") for line in out[:restored[0]])
    assert 0 < steps_before < STEPS, f"restore after {steps_before} steps: not mid-run"

    sacct = must("exec", "slurmctld", "sacct", "-n", "-P", "-X", "-j", job, "-o", "State,ExitCode,NodeList",
                 timeout=60).split()
    assert sacct == [f"COMPLETED|0:0|{then}"], sacct


def test_daemons_run_as_slurm_without_capabilities_and_nodes_confine_tasks(docker_cluster) -> None:
    """slurmctld and slurmdbd run as the slurm user in containers that hold only the capabilities their start
    needs and gain none through execve; a compute node (privileged: CRIU) gives a job's processes no way to
    gain privileges through a setuid binary, and binds each task to the cores Slurm allocated it."""
    for service in ("slurmctld", "slurmdbd"):
        assert must("exec", service, "ps", "-o", "user=", "-C", service, timeout=60).split() == ["slurm"], service
        status = must("exec", service, "cat", "/proc/1/status", timeout=60)
        caps = int(re.search(r"^CapBnd:\s*(\w+)", status, re.M).group(1), 16)
        # CHOWN DAC_OVERRIDE FOWNER KILL SETGID SETUID AUDIT_WRITE
        assert caps == sum(1 << n for n in (0, 1, 3, 5, 6, 7, 29)), f"{service}: bounding set {caps:#x}"
        assert re.search(r"^NoNewPrivs:\s*1", status, re.M), service
    assert re.search(r"^NoNewPrivs:\s*1", must("exec", "c1", "cat", "/proc/1/status", timeout=60), re.M)
    config = must("exec", "slurmctld", "scontrol", "show", "config", timeout=60)
    assert re.search(r"^TaskPlugin\s*=\s*task/affinity$", config, re.M), config
    assert re.search(r"^SlurmUser\s*=\s*slurm\(", config, re.M), config
    bound = must("exec", "slurmctld", "runuser", "-u", "ckptuser1", "--", "srun", "-n1", "-w", "c1",
                 "grep", "Cpus_allowed_list", "/proc/self/status", timeout=120)
    assert re.search(r"Cpus_allowed_list:\s*\d+$", bound, re.M), f"the task is not bound to one core: {bound}"
