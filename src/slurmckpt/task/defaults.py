"""Environment settings a checkpointed task starts with, unless the job set them itself: what the task's
libraries then do stays checkpointable (docs/gpu.md, "What slurmckpt sets in a checkpointed job").

User side: the wrapper adds them to the environment it asks the agent to launch with; the user could set
them anyway, and a job's own value always stands (its way to opt out of one setting); a site turns a group
off in slurmckpt.yaml.

- every task: USE_LIBUV=0. PyTorch's TCPStore (the rendezvous of torch.distributed) runs on libuv, whose
  versions >= 1.45 hold an io_uring instance, and criu cannot checkpoint io_uring; with USE_LIBUV=0 PyTorch
  uses its own socket loop (read by init_process_group's env:// and tcp:// rendezvous and by torchrun's).
  Config `torch_store_without_libuv`.
- GPU tasks: NCCL's intra-node transports, by how many GPUs the job has on the node (cuda/nccl.py: off with
  one GPU, the site's or the job's choice with several, said in the job's output). Config
  `nccl_checkpoint_transports` (all of it), `nccl_multi_gpu` (several GPUs).
- GPU tasks: started under `cuda-checkpoint --launch-job` where the site names the utility
  (`cuda_checkpoint_launch`) and the driver checkpoints CUDA IPC within such a job (>= 610): CUDA IPC between
  the task's processes is then checkpointed (cuda/ipc_peers.py).
- GPU tasks: each framework's memory on demand (cuda/frameworks.py). Config `gpu_growth_defaults`.

Not a variable but the same kind of default: every tree starts with io_uring blocked (init's seccomp filter,
set up by the root agent; config `block_io_uring`), which covers the rings USE_LIBUV cannot reach (torchrun's
own stores). The job opts out with SLURMCKPT_IO_URING=allow (`io_uring_wanted`), read here, on the user side.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

from slurmckpt.cuda import nccl
from slurmckpt.cuda.frameworks import growth_defaults
from slurmckpt.cuda.release import JOB_FILE_VAR, ipc_jobs

LIBUV_DEFAULTS = {"USE_LIBUV": "0"}
# What a wrapper added, as NAME=VALUE words: a step started from the batch script inherits the batch task's
# environment, and a value slurmckpt set there is not the job's own choice for the step (the job may choose
# otherwise for it: cuda/nccl.py)
ADDED = "SLURMCKPT_ADDED"
IO_URING_VAR = "SLURMCKPT_IO_URING"
IO_URING_CHOICES = ("allow", "block")


class DefaultsConfig(Protocol):
    @property
    def torch_store_without_libuv(self) -> bool: ...
    @property
    def nccl_checkpoint_transports(self) -> bool: ...
    @property
    def nccl_multi_gpu(self) -> str: ...
    @property
    def cuda_checkpoint_launch(self) -> str: ...
    @property
    def gpu_growth_defaults(self) -> bool: ...


@dataclass(frozen=True)
class Launch:
    """What a task starts with beyond its own: variables to add, a command to start it under, and what the
    job's output says about GPU transports (None: nothing to say)."""
    env: dict[str, str] = field(default_factory=dict)
    argv_prefix: tuple[str, ...] = ()
    transports: nccl.Transports | None = None


def uses_gpus(env: Mapping[str, str]) -> bool:
    """The task was given GPUs (Slurm sets CUDA_VISIBLE_DEVICES for a GRES allocation): the user side's
    guess, from the task's own environment. The root side takes a task's GPUs from Slurm's allocation
    (Agent._slurm_gpus_here), never from this."""
    value = env.get("CUDA_VISIBLE_DEVICES", "")
    return bool(value) and value not in ("NoDevFiles", "-1")


def without_inherited(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less what an outer wrapper added (ADDED) and the job left as it was: a variable the job changed
    since is its own."""
    added = dict(word.partition("=")[::2] for word in env.get(ADDED, "").split())
    return {k: v for k, v in env.items() if k != ADDED and not (k in added and added[k] == v)}


def marked(added: Mapping[str, str]) -> dict[str, str]:
    """The ADDED variable for what a wrapper added (none if nothing)."""
    return {ADDED: " ".join(f"{k}={v}" for k, v in sorted(added.items()))} if added else {}


def defaults(env: Mapping[str, str], config: DefaultsConfig, release: tuple[int, ...] | None) -> Launch:
    """What to add to a task's environment `env` on a node whose NVIDIA driver is `release`: every setting of
    a group the site keeps on whose variable the job did not set itself."""
    added: dict[str, str] = {}
    if config.torch_store_without_libuv:
        added.update(_unset(LIBUV_DEFAULTS, env))
    if not uses_gpus(env):
        return Launch(added)
    transports = None
    if config.nccl_checkpoint_transports:
        transports = nccl.choose(env, nccl.gpus_on_node(env), config.nccl_multi_gpu, release,
                                 config.cuda_checkpoint_launch)
        added.update(transports.env)
    if config.gpu_growth_defaults:
        added.update(growth_defaults(env))
    # a task already started in a cuda-checkpoint job (the job ran cuda-checkpoint itself) keeps its own
    in_job = bool(config.cuda_checkpoint_launch) and ipc_jobs(release) and JOB_FILE_VAR not in env
    prefix = (config.cuda_checkpoint_launch, "--launch-job") if in_job else ()
    return Launch(added, prefix, transports)


def _unset(settings: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in settings.items() if name not in env}


def io_uring_wanted(env: Mapping[str, str]) -> tuple[bool, str | None]:
    """Whether the job asked for io_uring (SLURMCKPT_IO_URING=allow), and a line for the job's stderr when the
    variable holds anything else than allow or block (the tree then starts with io_uring blocked: the job
    stays checkpointable)."""
    value = env.get(IO_URING_VAR)
    if value is None or value in IO_URING_CHOICES:
        return value == "allow", None
    return False, (f"{IO_URING_VAR}={value!r} is neither allow nor block: io_uring stays blocked for this task "
                   "(docs/gpu.md, \"io_uring\")")
