"""torch.distributed as users run it (docs/gpu.md, "What slurmckpt sets in a checkpointed job"): DDP over gloo,
`srun -n2` in the batch script, rendezvous through init_process_group's env:// with the TCPStore on rank 0,
DataLoader workers started with the default fork. PyTorch's TCPStore runs on libuv, whose io_uring criu
cannot checkpoint; slurmckpt starts every task with USE_LIBUV=0 (task/defaults.py), so no rank holds one.
The CPU build here; tests/gpu runs the same workload with CUDA tensors on the GPU machine."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.integration.slurmjob import node, run, submit, workdir

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from zdtm import expected_lines  # noqa: E402

USER = "ckptuser1"
TORCH = "/opt/slurmckpt/test-venv/bin/python"          # scripts/setup.sh torch
STEPS = 120


def ddp_lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.startswith("ddp ")]


def test_ddp_over_gloo_with_dataloader_workers_requeued_twice_equals_an_uninterrupted_run() -> None:
    """Two ranks on one node, each with two forked DataLoader workers, captured at an interval, requeued,
    captured and requeued again: rank 0's loss and weights at every step equal those of the same job run
    without interruption beside it (which loads its data without workers: the data is the same)."""
    wd = workdir(USER, "ddp")
    script = ("#!/bin/bash\nsrun -n2 {torch} ddp_train.py --steps {steps} --sleep 0.25 --workers {workers}\n"
              "echo \"epilogue rc=$?\"\n")
    plain = submit(USER, wd, script.format(torch=TORCH, steps=STEPS, workers=0), "-n2", "-w", node("node2"))
    job = submit(USER, wd, script.format(torch=TORCH, steps=STEPS, workers=2), "-n2", "-w", node("node3"),
                 "--checkpoint-interval=10s")
    try:
        job.wait_output(r"committed \(interval\)")
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", 2)           # both ranks
        job.wait_output(r"committed \(interval\)", 1 + job.text().count("committed (interval)"))
        job.requeue()
        job.wait_output(r"restored from checkpoint epoch", 4)
        assert job.wait_done() == "COMPLETED", job.text()[-3000:]
        assert plain.wait_done() == "COMPLETED", plain.text()[-3000:]
    finally:
        run("scancel", str(job.id), str(plain.id), check=False)
    text = job.text()
    assert "io_uring" not in text, text[-3000:]
    lines, reference = ddp_lines(text), ddp_lines(plain.text())
    assert reference[0] == "ddp ready world=2 device=cpu workers=0" and reference[-1] == "ddp done", reference[-3:]
    assert lines[0] == "ddp ready world=2 device=cpu workers=2", lines[:2]
    assert lines[1:] == reference[1:], "the restored run's steps differ from the uninterrupted run's"
    steps = [int(m.group(1)) for l in lines if (m := re.match(r"ddp step (\d+) ", l))]
    assert steps == list(range(STEPS)), "a step ran twice or not at all"
    assert "epilogue rc=0" in text and job.restarts() == 2


def test_a_process_holding_an_io_uring_is_refused_before_anything_is_frozen_naming_it() -> None:
    """What USE_LIBUV=0 does not cover (a program making its own ring): the capture is refused in its check
    stage, before any freeze, naming the pid, the program and the cause; the job runs on to a correct end
    and the checkpoint committed before stays."""
    wd = workdir(USER, "io-uring")
    job = submit(USER, wd, "#!/bin/bash\npython3 zdtm.py --steps 120 --sleep 0.2 --tag u --data data.txt "
                 "--ring-at 60\n", "-w", node("node1"), "--checkpoint-interval=10s")
    job.wait_output(r"committed \(interval\)")
    job.wait_output(r"ABORTED \(rank batch\.0, node [^,]+, stage check\): pid \d+ \(python3, /usr/bin/python3[.\d]*\) "
                    r"holds an io_uring instance: criu cannot checkpoint io_uring", timeout=120)
    assert job.wait_done() == "COMPLETED"
    assert job.app_lines() == expected_lines("u", 120)
