"""NCCL's intra-node transports on a node with several GPUs of the job (fake GRES gpu:2 in CI; docs/gpu.md,
"NCCL on a node with several GPUs"): turned off only as the site's explicit choice, said in the job's output
with what it costs, shown by `slurmckpt status JOB` as the job's user; a step started from the batch script
may choose NVLink instead, whatever the batch task's wrapper added to the environment the step inherits."""
from __future__ import annotations

from tests.integration.slurmjob import run, submit, workdir

CLI = "/opt/slurmckpt/venv/bin/slurmckpt"
USER = "ckptuser1"


def test_a_job_with_two_gpus_on_its_node_is_told_the_nccl_trade_and_a_step_may_keep_nvlink() -> None:
    wd = workdir(USER, "gpu-transports")
    job = submit(USER, wd, "#!/bin/bash\n"
                 "echo \"batch nccl=$NCCL_P2P_DISABLE,$NCCL_SHM_DISABLE,$NCCL_NVLS_ENABLE\"\n"
                 "SLURMCKPT_CFG_NCCL_MULTI_GPU=nvlink srun -n1 --overlap --gres=gpu:2 "
                 "bash -c 'echo \"step nccl=${NCCL_P2P_DISABLE:-unset},${NCCL_NVLS_ENABLE:-unset}\"'\n",
                 "--gres=gpu:2", "-w", "node1", "--checkpoint-interval=30m")
    assert job.wait_done() == "COMPLETED", job.text()
    text = job.text()
    assert "batch nccl=1,1,0" in text and "step nccl=unset,unset" in text, text
    assert ("2 GPUs of this job on node node1: NCCL's intra-node transports are off so that it can be "
            "checkpointed (the site's choice, nccl_multi_gpu in slurmckpt.yaml=sockets): collectives between "
            "these GPUs go over sockets, about 1/82 of NVLink's bandwidth per connection") in text, text
    assert ("2 GPUs of this job on node node1: NCCL keeps NVLink (the job's choice, "
            "SLURMCKPT_CFG_NCCL_MULTI_GPU=nvlink)") in text, text
    shown = run(CLI, "status", str(job.id), user=USER).stdout
    assert "   GPUs: step batch: 2 GPUs of this job on node node1: NCCL's intra-node transports are off" in shown, shown
    assert "   GPUs: step 0: 2 GPUs of this job on node node1: NCCL keeps NVLink (the job's choice" in shown, shown
