"""NCCL's intra-node transports by the job's GPUs on the node (cuda/nccl.py): off where that costs nothing
(one GPU), an explicit site or job choice with several, which the job's output and `slurmckpt status` show;
the NVLink-kept form (legacy CUDA IPC in a cuda-checkpoint job) only from driver 610 on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurmckpt.config import Config
from slurmckpt.cuda import nccl
from slurmckpt.store import summary
from slurmckpt.store.jobstore import JobStore
from slurmckpt.task import defaults as task_defaults

R580, R610 = (580, 159, 4), (610, 57, 4)
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


def test_one_gpu_on_the_node_gets_the_checkpointable_settings_and_no_trade_to_tell():
    t = nccl.choose({}, 1, "nvlink", R580, "")
    assert (t.mode, t.env, t.launch_job, t.line("n1")) == ("one-gpu", SOCKETS, False, None)


def test_several_gpus_on_the_node_get_the_sites_choice_said_with_its_cost():
    t = nccl.choose({}, 4, "sockets", R580, "")
    assert t.env == SOCKETS and t.chosen_by == "site"
    line = t.line("gpu7")
    assert line.startswith("4 GPUs of this job on node gpu7: NCCL's intra-node transports are off")
    assert "the site's choice, nccl_multi_gpu in slurmckpt.yaml=sockets" in line
    assert "about 1/82 of NVLink's bandwidth per connection" in line
    assert "SLURMCKPT_CFG_NCCL_MULTI_GPU=nvlink keeps NVLink" in line


def test_the_jobs_choice_wins_and_nvlink_sets_nothing():
    t = nccl.choose({"SLURMCKPT_CFG_NCCL_MULTI_GPU": "nvlink"}, 8, "sockets", R580, "")
    assert (t.mode, t.env, t.chosen_by) == ("nvlink", {}, "job")
    assert "NCCL keeps NVLink (the job's choice, SLURMCKPT_CFG_NCCL_MULTI_GPU=nvlink): a capture while NCCL " \
           "runs its intra-node transports is refused" in t.line("gpu7")


def test_a_variable_the_job_set_itself_stands():
    t = nccl.choose({"NCCL_P2P_DISABLE": "0"}, 4, "sockets", R580, "")
    assert t.env == {"NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


@pytest.mark.parametrize("release, tool, fallback", [
    (R580, "/usr/bin/cuda-checkpoint", "driver 580.159.04 cannot checkpoint CUDA IPC (from 610 on)"),
    (None, "/usr/bin/cuda-checkpoint", "driver unknown cannot checkpoint CUDA IPC (from 610 on)"),
    (R610, "", "the site has set no cuda-checkpoint (cuda_checkpoint_launch)"),
])
def test_nvlink_ipc_falls_back_to_sockets_where_the_driver_or_the_site_cannot_and_says_why(release, tool, fallback):
    t = nccl.choose({}, 4, "nvlink-ipc", release, tool)
    assert (t.mode, t.env, t.launch_job, t.fallback) == ("sockets", SOCKETS, False, fallback)
    assert f"nvlink-ipc was asked for, but {fallback}" in t.line("n1")


def test_nvlink_ipc_on_driver_610_keeps_nvlink_through_legacy_ipc_in_one_job():
    t = nccl.choose({}, 4, "nvlink-ipc", R610, "/usr/bin/cuda-checkpoint")
    assert (t.mode, t.env, t.launch_job) == ("nvlink-ipc", {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}, True)
    assert "legacy CUDA IPC, checkpointed by the driver as one job" in t.line("n1")


@pytest.mark.parametrize("env, gpus", [
    ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0"}, 4),     # --gpus-per-task: 1 seen, 4 on the node
    ({"SLURM_JOB_GPUS": "0,1,2", "CUDA_VISIBLE_DEVICES": "0"}, 3),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0),
    ({}, 0)])
def test_the_wrapper_counts_the_jobs_gpus_on_the_node_not_the_tasks(env, gpus):
    assert nccl.gpus_on_node(env) == gpus


def test_the_root_side_tells_the_trade_from_what_the_task_was_started_with():
    assert nccl.describe(SOCKETS, 1, "n1", False) is None
    assert "are off so that it can be checkpointed" in nccl.describe(SOCKETS, 4, "n1", False)
    assert "NCCL keeps NVLink (the site's choice" in nccl.describe({}, 4, "n1", False)
    ipc = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "SLURMCKPT_CFG_NCCL_MULTI_GPU": "nvlink-ipc"}
    assert "through legacy CUDA IPC" in nccl.describe(ipc, 4, "n1", True)
    assert "NCCL keeps NVLink (the job's choice" in nccl.describe(ipc, 4, "n1", False)    # not in a job: as is


def test_defaults_start_gpu_tasks_in_a_cuda_checkpoint_job_only_from_driver_610_on():
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    site = Config(cuda_checkpoint_launch="/usr/bin/cuda-checkpoint")
    assert task_defaults.defaults(env, site, R610).argv_prefix == ("/usr/bin/cuda-checkpoint", "--launch-job")
    assert task_defaults.defaults(env, site, R580).argv_prefix == ()
    assert task_defaults.defaults(env, Config(), R610).argv_prefix == ()
    assert task_defaults.defaults({**env, "CUDA_CHECKPOINT_JOB_FILE": "/proc/self/fd/3"}, site, R610).argv_prefix == ()
    assert task_defaults.defaults({}, site, R610).argv_prefix == ()                      # no GPU
    assert task_defaults.defaults(env, Config(nccl_checkpoint_transports=False), R580).transports is None


@pytest.mark.system
def test_status_shows_each_steps_trade(tmp_path: Path, monkeypatch):
    """The trade reaches `slurmckpt status JOB` through the run record (root's store -> the user's summary)."""
    from fake_slurm import FakeSlurm, squeue_answer, squeue_line
    from slurmckpt.cli import cli, lookup
    store = JobStore(tmp_path / "store", "c", 7)
    store.ensure()
    summary.update_run(store, {"restart_count": 0, "interval_s": 600})
    line = nccl.choose({}, 4, "sockets", R580, "").line("gpu7")
    summary.record_gpu_transports(store, "batch", line)
    summary.record_gpu_transports(store, "3", line.replace("4 GPUs", "8 GPUs"))
    summary.publish(store, str(tmp_path / "summaries"), uid=0)
    assert summary.read(str(tmp_path / "summaries"), "c", 7)["run"]["gpu_transports"]["batch"] == line
    (tmp_path / "slurmckpt.yaml").write_text(f"summary_dir: {tmp_path}/summaries\n")
    monkeypatch.setenv("SLURMCKPT_CONFIG", str(tmp_path / "slurmckpt.yaml"))
    lookup.cluster.cache_clear()
    FakeSlurm(squeue=squeue_answer(squeue_line(7)), scontrol="ClusterName = c\n").install(monkeypatch)
    out = CliRunner().invoke(cli, ["status", "7"]).output
    assert f"   GPUs: step batch: {line}\n" in out and "   GPUs: step 3: 8 GPUs of this job on node gpu7" in out
    doc = json.loads(CliRunner().invoke(cli, ["status", "7", "--json"]).output)
    assert doc[0]["summary"]["run"]["gpu_transports"]["3"].startswith("8 GPUs")


def test_nccl_at_work_over_legacy_ipc_in_a_job_is_refused_only_where_the_driver_cannot_take_it(tmp_path):
    """NVLink kept (NCCL_CUMEM_ENABLE=0, no NVLS) by a process started in a cuda-checkpoint job: the check lets
    it through from driver 610 on; on 580 it names NCCL and what is missing."""
    from slurmckpt.cuda.procscan import unsupported_reasons
    from slurmckpt.node import procfs
    from test_cuda_stage import FakeProc
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0",
           "CUDA_CHECKPOINT_JOB_FILE": "/proc/self/fd/5"}
    with procfs.rooted(tmp_path / "proc"):
        FakeProc(tmp_path / "proc").add(90, maps=["/x/libnccl.so.2"], env=env, threads={91: "NCCL Proxy"})
        assert unsupported_reasons([90], release=R610) == []
        [reason] = unsupported_reasons([90], release=R580)
        assert "runs NCCL (its thread 91 'NCCL Proxy')" in reason and "nccl_multi_gpu=nvlink keeps NVLink" in reason
