"""NCCL's intra-node transports in a checkpointed job: what a GPU task starts with, chosen by how many GPUs
the job has on the node, and the line that says what it costs (docs/gpu.md, "NCCL on a node with several
GPUs"). Pure functions: the user-side wrapper chooses (task/defaults.py), the root agent describes what a
task was started with for `slurmckpt status` (agent/events.py).

NCCL's intra-node transports hold state the CUDA checkpoint API of driver 580 refuses: P2P through cuMem
handles shared with cuMemExportToShareableHandle (NCCL >= 2.19's default), its shared-memory transport, and
NVLink multicast (NVLS: a live multicast object makes the driver's checkpoint hang). Without them NCCL moves
intra-node traffic through sockets: 5.5 GB/s per connection measured on the H100, 1/82 of NVLink4's
450 GB/s each way (benchmarks/nccl_fallback_path.py).

- One GPU of the job on the node: CHECKPOINT_ENV. It costs nothing: NCCL runs one rank per GPU, so the
  node has no second GPU for its P2P or NVLS to reach (several ranks on one GPU are refused by NCCL).
- Several GPUs of the job on the node: the trade is the site's choice (`nccl_multi_gpu` in slurmckpt.yaml)
  or the job's (SLURMCKPT_CFG_NCCL_MULTI_GPU in its environment), said in the job's output and shown by
  `slurmckpt status`:
    sockets     CHECKPOINT_ENV: checkpointable on every driver; collectives between the node's GPUs at the
                sockets' speed
    nvlink      nothing set: NCCL as without slurmckpt, at NVLink's speed; a capture while NCCL runs its
                intra-node transports is refused before anything is frozen (cuda/procscan.py)
    nvlink-ipc  NVLINK_ENV, the task started in one cuda-checkpoint job (`cuda_checkpoint_launch`): P2P over
                NVLink through legacy CUDA IPC (NCCL_CUMEM_ENABLE=0), which the driver checkpoints from
                release 610 on as one job (driver.IPC_JOB_RELEASE; cuda/ipc_peers.py); no NVLS. Where the
                driver is older or the site has no cuda-checkpoint, sockets, and the line says why.
A variable the job set itself is never changed (its own choice, as before).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from slurmckpt.cuda.release import IPC_JOB_RELEASE, ipc_jobs, release_text

CHECKPOINT_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
NVLINK_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
MODES = ("sockets", "nvlink", "nvlink-ipc")
JOB_CHOICE = "SLURMCKPT_CFG_NCCL_MULTI_GPU"
FALLBACK_RATIO = 82                 # NVLink4 per direction / the measured socket path, per connection
DOC = "docs/gpu.md, \"NCCL on a node with several GPUs\""


@dataclass(frozen=True)
class Transports:
    """What a GPU task starts with: its NCCL settings, whether it starts in a cuda-checkpoint job, and why."""
    gpus: int                       # the job's GPUs on this node
    mode: str                       # "one-gpu" or one of MODES (what applies, after any fallback)
    env: dict[str, str] = field(default_factory=dict)      # to add: only variables the job did not set
    launch_job: bool = False        # start the task under `cuda-checkpoint --launch-job`
    chosen_by: str = ""             # "site" or "job" (several GPUs only)
    fallback: str = ""              # why nvlink-ipc fell back to sockets

    def line(self, node: str) -> str | None:
        """What the job's output says about the trade (None with one GPU on the node: there is none)."""
        if self.mode == "one-gpu":
            return None
        who = (f"the job's choice, {JOB_CHOICE}" if self.chosen_by == "job" else "the site's choice, nccl_multi_gpu "
               "in slurmckpt.yaml")
        head = f"{self.gpus} GPUs of this job on node {node}: "
        if self.mode == "nvlink":
            return (head + f"NCCL keeps NVLink ({who}=nvlink): a capture while NCCL runs its intra-node transports "
                    f"is refused, naming them; {JOB_CHOICE}=sockets makes the job checkpointable at 1/"
                    f"{FALLBACK_RATIO} of NVLink's bandwidth per connection ({DOC})")
        if self.mode == "nvlink-ipc":
            return (head + f"NCCL keeps NVLink through legacy CUDA IPC, checkpointed by the driver as one job "
                    f"(NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0, started under cuda-checkpoint --launch-job; "
                    f"{who}=nvlink-ipc; driver >= {IPC_JOB_RELEASE}) ({DOC})")
        why = f"; nvlink-ipc was asked for, but {self.fallback}" if self.fallback else ""
        return (head + f"NCCL's intra-node transports are off so that it can be checkpointed ({who}=sockets"
                f"{why}): collectives between these GPUs go over sockets, about 1/{FALLBACK_RATIO} of NVLink's "
                f"bandwidth per connection; {JOB_CHOICE}=nvlink keeps NVLink and refuses captures while NCCL "
                f"runs ({DOC})")


def choose(env: Mapping[str, str], gpus: int, mode: str, release: tuple[int, ...] | None,
           cuda_checkpoint: str) -> Transports:
    """The settings of a GPU task whose job has `gpus` GPUs on this node, in mode `mode` (the job's
    JOB_CHOICE in `env` wins over the site's `mode`), on a driver of `release`, with the site's
    cuda-checkpoint utility `cuda_checkpoint` ("" none)."""
    if gpus <= 1:
        return Transports(gpus, "one-gpu", _unset(CHECKPOINT_ENV, env))
    chosen_by = "job" if env.get(JOB_CHOICE) in MODES else "site"
    mode = env[JOB_CHOICE] if chosen_by == "job" else mode
    if mode == "nvlink":
        return Transports(gpus, mode, {}, chosen_by=chosen_by)
    if mode == "nvlink-ipc":
        why = ("the site has set no cuda-checkpoint (cuda_checkpoint_launch)" if not cuda_checkpoint else
               "" if ipc_jobs(release) else
               f"driver {release_text(release)} cannot checkpoint CUDA IPC (from {IPC_JOB_RELEASE} on)")
        if not why:
            return Transports(gpus, mode, _unset(NVLINK_ENV, env), launch_job=True, chosen_by=chosen_by)
        return Transports(gpus, "sockets", _unset(CHECKPOINT_ENV, env), chosen_by=chosen_by, fallback=why)
    return Transports(gpus, "sockets", _unset(CHECKPOINT_ENV, env), chosen_by=chosen_by)


def describe(env: Mapping[str, str], gpus: int, node: str, launched_in_job: bool) -> str | None:
    """What a task was started with, told from its launch environment (root side, for `slurmckpt status`):
    the same line `choose` gave its wrapper, as far as the environment shows it. None with one GPU."""
    if gpus <= 1:
        return None
    chosen_by = "job" if env.get(JOB_CHOICE) in MODES else "site"
    if all(env.get(k) == v for k, v in CHECKPOINT_ENV.items()):
        mode = "sockets"
    elif launched_in_job and all(env.get(k) == v for k, v in NVLINK_ENV.items()):
        mode = "nvlink-ipc"
    else:
        mode = "nvlink"
    return Transports(gpus, mode, chosen_by=chosen_by).line(node)


def gpus_on_node(env: Mapping[str, str]) -> int:
    """The job's GPUs on this node as the task's own environment tells (user side only: root takes them
    from Slurm's allocation): SLURM_GPUS_ON_NODE, else SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES."""
    count = env.get("SLURM_GPUS_ON_NODE", "")
    if count.isdigit():
        return int(count)
    for name in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        items = [i for i in env.get(name, "").split(",") if i.strip()]
        if items and items != ["NoDevFiles"]:
            return len(items)
    return 0


def _unset(settings: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in settings.items() if name not in env}
