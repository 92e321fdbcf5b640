"""Environment settings a checkpointed task starts with, unless the job set them itself: what the task's
libraries then do stays checkpointable (docs/gpu.md, "What slurmckpt sets in a checkpointed job").

User side: the wrapper adds them to the environment it asks the agent to launch with; the user could set
them anyway, and a job's own value always stands (its way to opt out of one setting); a site turns a group
off in slurmckpt.yaml.

- every task: USE_LIBUV=0. PyTorch's TCPStore (the rendezvous of torch.distributed) runs on libuv, whose
  versions >= 1.45 hold an io_uring instance, and criu cannot checkpoint io_uring; with USE_LIBUV=0 PyTorch
  uses its own socket loop (read by init_process_group's env:// and tcp:// rendezvous and by torchrun's).
  Config `torch_store_without_libuv`.
- GPU tasks: NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1, NCCL_NVLS_ENABLE=0. NCCL's intra-node transports hold
  cross-GPU state (CUDA IPC, shared host memory, NVLink multicast) that the CUDA checkpoint API refuses;
  without them NCCL moves intra-node traffic through the network path. Config `nccl_checkpoint_transports`.
- GPU tasks: each framework's memory on demand (cuda/frameworks.py). Config `gpu_growth_defaults`.

Not a variable but the same kind of default: every tree starts with io_uring blocked (init's seccomp filter,
set up by the root agent; config `block_io_uring`), which covers the rings USE_LIBUV cannot reach (torchrun's
own stores). The job opts out with SLURMCKPT_IO_URING=allow (`io_uring_wanted`), read here, on the user side.
"""
from __future__ import annotations

from typing import Mapping, Protocol

from slurmckpt.cuda.frameworks import growth_defaults

LIBUV_DEFAULTS = {"USE_LIBUV": "0"}
IO_URING_VAR = "SLURMCKPT_IO_URING"
IO_URING_CHOICES = ("allow", "block")
NCCL_DEFAULTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


class DefaultsConfig(Protocol):
    @property
    def torch_store_without_libuv(self) -> bool: ...
    @property
    def nccl_checkpoint_transports(self) -> bool: ...
    @property
    def gpu_growth_defaults(self) -> bool: ...


def uses_gpus(env: Mapping[str, str]) -> bool:
    """The task was given GPUs (Slurm sets CUDA_VISIBLE_DEVICES for a GRES allocation): the user side's
    guess, from the task's own environment. The root side takes a task's GPUs from Slurm's allocation
    (Agent._slurm_gpus_here), never from this."""
    value = env.get("CUDA_VISIBLE_DEVICES", "")
    return bool(value) and value not in ("NoDevFiles", "-1")


def defaults(env: Mapping[str, str], config: DefaultsConfig) -> dict[str, str]:
    """What to add to a task's environment `env`: every setting of a group the site keeps on whose variable
    the job did not set itself."""
    added: dict[str, str] = {}
    if config.torch_store_without_libuv:
        added.update(_unset(LIBUV_DEFAULTS, env))
    if uses_gpus(env):
        if config.nccl_checkpoint_transports:
            added.update(_unset(NCCL_DEFAULTS, env))
        if config.gpu_growth_defaults:
            added.update(growth_defaults(env))
    return added


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
