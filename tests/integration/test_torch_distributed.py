"""torch.distributed as users run it (docs/gpu.md, "What slurmckpt sets in a checkpointed job" and "io_uring"):
DDP over gloo with DataLoader workers started with the default fork, launched by `srun -n2` (rendezvous through
init_process_group's env://, TCPStore on rank 0) or by torchrun on two nodes (c10d rendezvous, the agents'
store). PyTorch's TCPStore runs on libuv, whose io_uring criu cannot checkpoint: USE_LIBUV=0 keeps it off where
PyTorch reads the variable, the io_uring block of every tree everywhere else (torchrun's agent). The CPU
build here; tests/gpu runs the same workload with CUDA tensors on the GPU machine."""
from __future__ import annotations

import re

from tests.integration.slurmjob import Job, node, run, submit, workdir

USER = "ckptuser1"
TORCH = "/opt/slurmckpt/test-venv/bin/python"          # scripts/setup.sh torch
TORCHRUN = "/opt/slurmckpt/test-venv/bin/torchrun"
STEPS = 120


def ddp_lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.startswith("ddp ")]


def requeued_twice(job: Job, ranks: int) -> None:
    """Captured at an interval, requeued, restored (`ranks` of them), captured and requeued again, restored."""
    job.wait_output(r"committed \(interval\)")
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", ranks)
    job.wait_output(r"committed \(interval\)", 1 + job.text().count("committed (interval)"))
    job.requeue()
    job.wait_output(r"restored from checkpoint epoch", 2 * ranks)


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
        requeued_twice(job, 2)
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


def test_torchrun_across_two_nodes_requeued_twice_equals_an_uninterrupted_run() -> None:
    """torchrun as people start it on a cluster: one agent per node (`srun` one task per node), c10d rendezvous
    on the first node, one worker per node, DDP over gloo. torchrun's agent makes its rendezvous store with
    libuv whatever USE_LIBUV says; under slurmckpt's io_uring block libuv keeps epoll, so no process holds a
    ring and every capture goes through. Requeued twice: rank 0's steps equal an uninterrupted run's (two
    ranks of `srun -n2` on one node: the same data, the same all-reduce)."""
    wd = workdir(USER, "torchrun")
    script = ("#!/bin/bash\nhead=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -1)\n"
              "srun --ntasks-per-node=1 {torchrun} --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d "
              "--rdzv-endpoint=$head:$((20000 + SLURM_JOB_ID % 20000)) --rdzv-id=$SLURM_JOB_ID "
              "ddp_train.py --steps {steps} --sleep 0.25 --workers 2\necho \"epilogue rc=$?\"\n")
    plain = submit(USER, wd, "#!/bin/bash\nsrun -n2 {torch} ddp_train.py --steps {steps} --sleep 0\n".format(
        torch=TORCH, steps=STEPS), "-n2", "-w", node("node3"))
    job = submit(USER, wd, script.format(torchrun=TORCHRUN, steps=STEPS), "-N2", "-w", "node1,node2",
                 "--checkpoint-interval=10s")
    try:
        requeued_twice(job, 2)
        assert job.wait_done() == "COMPLETED", job.text()[-3000:]
        assert plain.wait_done() == "COMPLETED", plain.text()[-3000:]
    finally:
        run("scancel", str(job.id), str(plain.id), check=False)
    text = job.text()
    assert "io_uring" not in text and "ABORTED" not in text, text[-3000:]
    lines, reference = ddp_lines(text), ddp_lines(plain.text())
    assert lines[0] == "ddp ready world=2 device=cpu workers=2", lines[:2]
    assert lines[1:] == reference[1:] and reference[-1] == "ddp done", \
        "the restored run's steps differ from the uninterrupted run's"
    assert "epilogue rc=0" in text and job.restarts() == 2
