"""CUDA IPC between the processes of a tree, as /proc shows it, and whether the driver can checkpoint it
(docs/gpu.md, "CUDA IPC").

Legacy CUDA IPC: one process exports device memory (cudaIpcGetMemHandle, and an event with
cudaIpcGetEventHandle), another maps it (cudaIpcOpenMemHandle). torch.multiprocessing passes every CUDA
tensor so (an actor/learner pair, a data-loading producer), as do inference engines' workers. Driver 580's
checkpoint API cannot checkpoint such processes; from driver 610 on (driver.IPC_JOB_RELEASE) it checkpoints
them when they were started in one cuda-checkpoint job (`cuda-checkpoint --launch-job`, which gives the
program a job file named by CUDA_CHECKPOINT_JOB_FILE), all locked before any is checkpointed, then
checkpointed, restored and unlocked one after another in one order (cuda/stage.py).

How it shows: the CUDA runtime backs IPC handles with a file in /dev/shm named `cuda.shm.*`, which every
process taking part maps (cleanup scripts of PyTorch and SGLang users remove `/dev/shm/cuda.shm.*` as CUDA
IPC's leftovers; and the actor/learner pair on the GPU machine was refused by an earlier check that read such
a mapping as MPS). Processes that map one such file (same device and inode) share CUDA IPC state.
`IPC_FILE_PREFIX` is the one constant tests/gpu/ipc_probe.py decides on the GPU machine: it prints what an
exporter and an importer map and hold, with and without IPC events. An importer that showed no such file
would be left to the driver, which refuses it at the GPU checkpoint (the stage then rolls back).

MPS is another thing: a client of an MPS server (nvidia-cuda-mps-server) runs its work inside the server's
context; procscan.py names MPS only when an MPS daemon runs, NVML (inventory.py) when it lists the process as
an MPS client.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

from slurmckpt.cuda.release import IPC_JOB_RELEASE, JOB_FILE_VAR, ipc_jobs, release_text
from slurmckpt.node import procfs

IPC_FILE_PREFIX = "/dev/shm/cuda.shm"
_OWN_FD = re.compile(r"/proc/self/fd/(\d+)")


@dataclass(frozen=True)
class IpcShare:
    """One IPC file of the CUDA runtime and the processes of the tree that hold it (mapped or open)."""
    path: str
    pids: tuple[int, ...]


def shares(pids: Sequence[int]) -> list[IpcShare]:
    """Every CUDA IPC file the processes `pids` hold, with its holders among them; the same file (device
    and inode, not name: a name can be unlinked and made again) held by several is one share."""
    found: dict[tuple[str, str], tuple[str, set[int]]] = {}
    for pid in pids:
        for key, name in _held(pid):
            found.setdefault(key, (name, set()))[1].add(pid)
    return sorted((IpcShare(name, tuple(sorted(holders))) for name, holders in found.values()),
                  key=lambda s: (s.pids, s.path))


def _held(pid: int) -> list[tuple[tuple[str, str], str]]:
    out = []
    for parts in procfs.maps(pid):
        if len(parts) == 6 and parts[5].startswith(IPC_FILE_PREFIX):
            out.append(((parts[3], parts[4]), parts[5].removesuffix(" (deleted)")))
    for fd in procfs.fds(pid):
        try:
            link = procfs.fd_link(pid, fd)
            if not link.startswith(IPC_FILE_PREFIX):
                continue
            st = procfs.fd_stat(pid, fd)
        except OSError:
            continue
        out.append(((f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino)),
                    link.removesuffix(" (deleted)")))
    return out


def job_of(pid: int) -> str | None:
    """Which cuda-checkpoint job `pid` was started in: the inode of its job file where the process still
    holds the fd CUDA_CHECKPOINT_JOB_FILE names (`/proc/self/fd/N`, a memfd), else the variable's value;
    None when it was not started in one. What the variable names is the job's own: root only stats an fd
    of the process, never opens a path the job chose."""
    value = procfs.environ(pid).get(JOB_FILE_VAR)
    if not value:
        return None
    m = _OWN_FD.fullmatch(value)
    if m:
        try:
            if procfs.fd_link(pid, int(m.group(1))).startswith("/memfd:"):
                return f"memfd:{procfs.fd_stat(pid, int(m.group(1))).st_ino}"
        except OSError:
            pass
    return f"env:{value[:200]}"


def one_job(pids: Sequence[int]) -> bool:
    """Every process was started in a cuda-checkpoint job, and those whose job file is still open share it.
    A process that closed its copy (multiprocessing's spawn closes every fd it does not pass) counts by its
    variable: the driver has the last word, at the lock."""
    jobs = [job_of(pid) for pid in pids]
    if any(j is None for j in jobs):
        return False
    files = {j for j in jobs if j and j.startswith("memfd:")}
    return len(files) <= 1


def _named(pid: int) -> str:
    try:
        return f"pid {pid} ({procfs.comm(pid)})"
    except OSError:
        return f"pid {pid}"


def refusals(pids: Sequence[int], release: tuple[int, ...] | None) -> list[str]:
    """Why CUDA IPC among `pids` cannot be checkpointed here, one reason per share, naming its processes
    and CUDA IPC; [] where there is none or the driver checkpoints it (one job, driver >= 610)."""
    out = []
    for share in shares(pids):
        who = " and ".join(_named(p) for p in share.pids)
        if len(share.pids) == 1:
            out.append(f"{who} holds CUDA IPC state ({share.path}) that no other process of this task's tree "
                       "holds: its peer is in another task (each task's tree is captured on its own, so CUDA "
                       "IPC between tasks cannot be checkpointed), or has not opened it yet or has ended")
            continue
        what = (f"{who} share GPU memory through CUDA IPC (cudaIpcGetMemHandle/cudaIpcOpenMemHandle, as "
                f"torch.multiprocessing passes CUDA tensors; all map {share.path})")
        if not ipc_jobs(release):
            out.append(f"{what}: the CUDA checkpoint API of driver {release_text(release)} cannot checkpoint CUDA "
                       f"IPC; drivers from {IPC_JOB_RELEASE} on checkpoint it between processes started in one "
                       "cuda-checkpoint job (docs/gpu.md, \"CUDA IPC\")")
        elif not one_job(share.pids):
            outside = [p for p in share.pids if job_of(p) is None]
            out.append(f"{what}: driver {release_text(release)} checkpoints CUDA IPC only between processes "
                       f"started in one cuda-checkpoint job, and "
                       + (f"{' and '.join(_named(p) for p in outside)} started in none" if outside else
                          "they were started in different ones")
                       + " (slurmckpt starts GPU tasks in one where the site sets cuda_checkpoint_launch; "
                       "docs/gpu.md, \"CUDA IPC\")")
    return out


def job_members(pids: Sequence[int], release: tuple[int, ...] | None) -> bool:
    """The tree holds CUDA IPC that the driver checkpoints as one job: its GPU stage then goes one process
    after another in one order (cuda/stage.py)."""
    return ipc_jobs(release) and any(len(s.pids) > 1 for s in shares(pids)) and not refusals(pids, release)
