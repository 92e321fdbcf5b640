"""What /proc tells about a tree's CUDA processes, without libcuda: which processes hold CUDA state, which
use a GPU feature the CUDA checkpoint API cannot capture, which cannot run right now (stopped or frozen).

What a GPU job must do to be checkpointable (driver 580): no MPS, no MIG instance, no managed (UVM) memory,
no CUDA IPC between processes (ipc_peers.py: named with both pids; from driver 610 on, checkpointed within one
cuda-checkpoint job); several GPUs or ranks per node with NCCL only with its intra-node transports off or in
the form the driver checkpoints (cuda/nccl.py says which and what it costs).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Sequence

from slurmckpt.node import procfs
from slurmckpt.node.sock_diag import unix_sockets
from slurmckpt.cuda import ipc_peers
from slurmckpt.cuda.driver import GpuDriver, GpuDriverError, ProcessState
from slurmckpt.cuda.release import ipc_jobs
from slurmckpt.cuda.nccl import CHECKPOINT_ENV as NCCL_CHECKPOINT_ENV, DOC as NCCL_DOC, NVLINK_ENV as NCCL_NVLINK_ENV

log = logging.getLogger("slurmckpt.cuda")

MPS_DAEMONS = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def _read(path: str) -> str:
    """A cgroup file (not /proc: procfs.py reads that); "" if absent."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _map_paths(pid: int) -> list[str]:
    return [parts[5] for parts in procfs.maps(pid) if len(parts) == 6]


def process_environ(pid: int) -> dict[str, str]:
    return procfs.environ(pid)


def ns_pid(pid: int) -> int | None:
    """The pid in the innermost PID namespace (what stays the same across a CRIU restore)."""
    try:
        return int(procfs.status(pid)["NSpid"][-1])
    except (OSError, KeyError, IndexError, ValueError):
        return None


def uses_nvidia(pid: int) -> bool:
    """The process holds a /dev/nvidia* fd or mapping (every CUDA process does; a checkpointed one does not)."""
    return any(p.startswith("/dev/nvidia") for p in procfs.fd_links(pid) + _map_paths(pid))


def maps_nvidia(pid: int) -> bool:
    """The process maps a /dev/nvidia* device (a CUDA process does until its GPU checkpoint releases it)."""
    return any(p.startswith("/dev/nvidia") for p in _map_paths(pid))


def inherited_device_majors(pids: Sequence[int]) -> list[int]:
    """The NVIDIA character device majors for criu's --inherited-device-major, when a process of the frozen
    tree still holds a /dev/nvidia* fd or mapping after every CUDA process's GPU checkpoint released its own:
    a child forked from a CUDA process without exec (PyTorch's DataLoader workers with the default fork start
    method, OpenMPI's daemon started by mpi4py) keeps its parent's device mappings and fds, has no CUDA
    context and never uses them. criu (our patch 0004) keeps those mappings as inaccessible reservations of
    the same range and reopens the fds by path; [] when no process holds any."""
    holders = [pid for pid in pids if uses_nvidia(pid)]
    if not holders:
        return []
    for pid in holders:
        try:
            name = procfs.comm(pid)
        except OSError:
            continue
        log.info("pid %d (%s) keeps GPU device mappings it holds no CUDA context for (forked from a CUDA "
                 "process): dumped as reservations", pid, name)
    return procfs.char_device_majors("nvidia")


def condition(pid: int) -> str:
    """One line on what a process is doing now, for an error about it: gone, or its state, threads by state
    and /dev/nvidia* fds (a restored process that died or stopped before its GPU restore tells apart here)."""
    try:
        st = procfs.stat(pid)
        states: dict[str, int] = {}
        for tid in procfs.threads(pid):
            try:
                s = procfs.stat(tid).state
            except OSError:
                continue
            states[s] = states.get(s, 0) + 1
        nvidia = sum(1 for link in procfs.fd_links(pid) if link.startswith("/dev/nvidia"))
    except OSError:
        return f"process {pid} is gone"
    threads = " ".join(f"{k}x{v}" for k, v in sorted(states.items()))
    return f"process {pid} ({st.comm}) state {st.state}, threads {threads}, {nvidia} /dev/nvidia* fds"


def find_cuda_pids(pids: Sequence[int], driver: GpuDriver | None = None) -> list[int]:
    """The pids of `pids` holding CUDA state, in the given order. The /proc scan needs no libcuda; with a
    driver, each candidate is confirmed with GetState (NO_CUDA: dropped; a vanished pid: dropped)."""
    found = [pid for pid in pids if uses_nvidia(pid)]
    if driver is None:
        return found
    confirmed = []
    for pid in found:
        try:
            if driver.state(pid) is not ProcessState.NO_CUDA:
                confirmed.append(pid)
        except GpuDriverError as e:
            if e.code != 304:     # CUDA_ERROR_OPERATING_SYSTEM: the process is gone
                raise
    return confirmed


def _mps_daemon(pid: int) -> str | None:
    """The MPS daemon's name if `pid` is one (the kernel keeps 15 bytes of a process's name)."""
    name = os.path.basename(procfs.exe(pid))
    if name in MPS_DAEMONS:
        return name
    try:
        comm = procfs.comm(pid)
    except OSError:
        return None
    return next((d for d in MPS_DAEMONS if comm in (d, d[:15])), None)


def unsupported_reasons(pids: Sequence[int], nccl_env_required: bool = True,
                        release: tuple[int, ...] | None = None) -> list[str]:
    """What in these (CUDA) processes the driver of `release` (driver.release(); None: unknown, taken as
    the oldest) cannot checkpoint, each reason naming the cause and the pids."""
    reasons: list[str] = []
    for other in (procfs.pids() if pids else []):
        if (daemon := _mps_daemon(other)):
            reasons.append(f"CUDA MPS daemon running (pid {other}, {daemon}): "
                           f"processes under MPS cannot be checkpointed; run the job without MPS")
            break
    reasons += ipc_peers.refusals(pids, release)
    unix_names = _unix_socket_names()
    for pid in pids:
        env, maps, fds = process_environ(pid), _map_paths(pid), procfs.fd_links(pid)
        if any(v.strip().upper().startswith("MIG-") for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",")) \
                or any(_is_mig_access_cap(p) for p in fds + maps):
            reasons.append(f"pid {pid} uses a MIG instance: MIG is not supported by the CUDA checkpoint API")
        uvm = _uvm_mapping_sizes(pid)
        if len(uvm) > 1:
            reasons.append(f"pid {pid} uses managed (UVM) memory ({len(uvm)} /dev/nvidia-uvm mappings, "
                           f"{sum(uvm) >> 20} MiB): cudaMallocManaged memory is not supported by the CUDA "
                           f"checkpoint API (driver 580 answers CUDA_ERROR_NOT_SUPPORTED)")
        if any(p.startswith("/dev/shm/nccl-") for p in maps + fds):
            reasons.append(f"pid {pid} uses NCCL's shared-memory transport (/dev/shm/nccl-*): set NCCL_SHM_DISABLE=1")
        if nccl_env_required and any("libnccl" in os.path.basename(p) for p in maps) and _shares_node(env):
            # every PyTorch process maps libnccl, used or not: refused only on evidence that NCCL runs here
            missing = [f"{k}={v}" for k, v in NCCL_CHECKPOINT_ENV.items() if env.get(k) != v]
            if missing and ipc_jobs(release) and ipc_peers.job_of(pid) \
                    and all(env.get(k) == v for k, v in NCCL_NVLINK_ENV.items()):
                missing = []      # NVLink kept through legacy CUDA IPC in a cuda-checkpoint job (cuda/nccl.py)
            evidence = nccl_at_work(pid, fds, unix_names) if missing else None
            if evidence:
                reasons.append(f"pid {pid} runs NCCL ({evidence}) with several GPUs or ranks on this node and "
                               f"without {' '.join(missing)} (slurmckpt sets them unless the job set them "
                               f"itself or nccl_multi_gpu=nvlink keeps NVLink): NCCL's P2P/SHM/NVLS transports "
                               f"hold cross-GPU state the CUDA checkpoint API refuses ({NCCL_DOC})")
    return reasons


def nccl_at_work(pid: int, fds: list[str], unix_names: dict[str, str]) -> str | None:
    """What shows that NCCL built a communicator in `pid`, or None: the unix socket it passes CUDA memory
    handles over (NCCL >= 2.19, P2P through cuMem: an abstract name with "nccl-socket"), or its named CPU
    threads ("NCCL Proxy", "NCCL Progress", "NCCL Service": names NCCL gives where NCCL_SET_THREAD_NAME is
    on). A communicator that shows neither (legacy CUDA IPC) is refused by the driver at the GPU
    checkpoint instead, and the capture rolls back."""
    for link in fds:
        name = unix_names.get(link, "")
        if "nccl-socket" in name:
            return f"its socket {name}"
    for tid in procfs.threads(pid):
        try:
            comm = procfs.thread_comm(pid, tid)
        except OSError:
            continue
        if comm.startswith("NCCL"):
            return f"its thread {tid} {comm!r}"
    return None


def _unix_socket_names() -> dict[str, str]:
    """socket:[INO] -> bound name of every named unix socket of this network namespace ({} if unknown)."""
    try:
        return {f"socket:[{ino}]": s.name for ino, s in unix_sockets().items() if s.name}
    except OSError:
        return {}


def _is_mig_access_cap(path: str) -> bool:
    """/dev/nvidia-caps/nvidia-capN of a MIG GPU/compute instance. Minors 1 and 2 (mig/config, mig/monitor)
    are opened by every CUDA process on driver 580, MIG or not (seen on the H200)."""
    if not path.startswith("/dev/nvidia-caps/nvidia-cap"):
        return False
    minor = path.rsplit("nvidia-cap", 1)[1]
    return not minor.isdigit() or int(minor) > 2


def _uvm_mapping_sizes(pid: int) -> list[int]:
    """Sizes of the /dev/nvidia-uvm mappings. A plain CUDA process has one (torch and CuPy on driver 580: 2 MiB
    at 0x204a00000); a managed allocation adds one of its size (seen: 64 MiB cudaMallocManaged -> 2 mappings)."""
    out = []
    for parts in procfs.maps(pid):
        if len(parts) == 6 and parts[5] == "/dev/nvidia-uvm":
            lo, _, hi = parts[0].partition("-")
            out.append(int(hi, 16) - int(lo, 16))
    return out


def frozen_reason(pid: int, cgroup_root: str = "/sys/fs/cgroup", stopped_ok: bool = False) -> str | None:
    """Why `pid` cannot run right now (stopped, or in a frozen cgroup), else None. The CUDA checkpoint API
    works through a thread inside the target process: on driver 580 Lock (even with a timeout), Checkpoint,
    Restore, Unlock and GetState hang on a SIGSTOPped or cgroup-frozen process (seen on the H200).
    `stopped_ok`: a stopped process is fine (its restore thread is run alone for the call: node/stopped.py)."""
    try:
        state, cgroups = procfs.status(pid).get("State", []), procfs.cgroups(pid)
    except OSError:
        return None
    if state and state[0] in ("T", "t") and not stopped_ok:
        return f"process {pid} is stopped ({' '.join(state)})"
    for hier, controllers, path in cgroups:
        if hier == "0" and controllers == "":
            if "frozen 1" in _read(f"{cgroup_root}{path}/cgroup.events") or \
                    _read(f"{cgroup_root}{path}/cgroup.freeze").strip() == "1":
                return f"process {pid} is in frozen cgroup {path}"
        elif "freezer" in controllers.split(","):
            v1_state = _read(f"{cgroup_root}/freezer{path}/freezer.state").strip()
            if v1_state in ("FROZEN", "FREEZING"):
                return f"process {pid} is in {v1_state} freezer cgroup {path}"
    return None


def _shares_node(env: dict[str, str]) -> bool:
    """Could NCCL pick an intra-node transport (P2P, SHM, NVLS)? Only with >1 GPU visible to the process or
    >1 task of the step on one node (torch maps libnccl in every CUDA process, used or not)."""
    gpus = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    peers = [env.get("LOCAL_WORLD_SIZE", ""), env.get("SLURM_NTASKS_PER_NODE", "")]
    peers += re.findall(r"\d+", re.sub(r"\(x\d+\)", "", env.get("SLURM_STEP_TASKS_PER_NODE", "")))
    return len(gpus) > 1 or any(p.isdigit() and int(p) > 1 for p in peers)
