"""Device probe (root, GPU): what CUDA IPC between two processes leaves in /proc and what the driver's
checkpoint API answers for it, for cuda/ipc_peers.py (docs/gpu.md, "CUDA IPC").

Cases, each a pair of processes that share device memory:
  torch  an actor/learner pair: torch.multiprocessing with spawn; the learner puts a CUDA tensor on a Queue,
         the actor holds it (what torch does: cudaIpcGetMemHandle + an IPC event, and its ref counter file)
  raw    two processes on libcuda through ctypes: cuIpcGetMemHandle in one, cuIpcOpenMemHandle in the other,
         no IPC event
For each process: its /proc/PID/maps lines of /dev/nvidia* and /dev/shm (device and inode), its fds (and the
inode of each /dev/shm one), its CUDA_*/NCCL_* environment; the MPS daemons on the node; what the check stage
decides (ipc_peers.shares, procscan.unsupported_reasons); then the driver, each call in a child with a timeout
(a call on an IPC process may hang): GetState, Lock(2000 ms) of both, Checkpoint of the exporter then the
importer, Restore and Unlock of whatever was checkpointed or locked, and the data read again.

One `key: json` line per fact and one VERDICT line per case:
  VERDICT <case> prefix-holds      both processes hold a file named ipc_peers.IPC_FILE_PREFIX* of one inode:
                                   the constant is right for this case
  VERDICT <case> prefix-missing    they do not; `shared_files` lists every file both hold (same inode): the
                                   candidates for IPC_FILE_PREFIX
and `driver <case>` says what the checkpoint API did (ok / CUresult / hang), which is what docs/gpu.md's
"CUDA IPC" and the fake driver (cuda/fake.py: CUDA_ERROR_NOT_SUPPORTED on driver 580) assume.

    python3 tests/gpu/ipc_probe.py WORKDIR [torch] [raw]
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
from slurmckpt.cuda import ipc_peers  # noqa: E402
from slurmckpt.cuda.release import release  # noqa: E402
from slurmckpt.cuda.procscan import unsupported_reasons  # noqa: E402
from slurmckpt.node import procfs  # noqa: E402

SIZE = 64 << 20
FILL = 0x5A


def say(key: str, value: object) -> None:
    print(f"{key}: {json.dumps(value, default=str)}", flush=True)


# ---- the pairs ---------------------------------------------------------------------------------------------
def torch_learner(q, ready: str, stop: str) -> None:
    import torch
    t = torch.full((SIZE // 4,), 7, dtype=torch.int32, device="cuda")
    q.put(t)
    Path(ready, "learner").write_text(str(os.getpid()))
    while not Path(stop).exists():
        time.sleep(0.1)


def torch_actor(q, ready: str, stop: str, check: str) -> None:
    t = q.get()
    Path(ready, "actor").write_text(str(os.getpid()))
    while not Path(stop).exists():
        if Path(check).exists():
            Path(check).unlink()
            Path(ready, "actor-sum").write_text(str(int(t.sum().item())))
        time.sleep(0.1)


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _cuda() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for rc in (cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), 0),
               cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), cu.cuCtxSetCurrent(ctx)):
        assert rc == 0, rc
    return cu


def raw_role(role: str, ready: str, stop: str, check: str) -> None:
    cu = _cuda()
    ptr, handle = ctypes.c_uint64(), Handle()
    if role == "exporter":
        assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(SIZE)) == 0
        assert cu.cuMemsetD8_v2(ptr, ctypes.c_ubyte(FILL), ctypes.c_size_t(SIZE)) == 0
        assert cu.cuIpcGetMemHandle(ctypes.byref(handle), ptr) == 0
        Path(ready, "handle").write_bytes(bytes(handle.reserved).ljust(64, b"\0"))
    else:
        while not Path(ready, "handle").exists():
            time.sleep(0.05)
        ctypes.memmove(ctypes.byref(handle), Path(ready, "handle").read_bytes(), 64)
        opener = getattr(cu, "cuIpcOpenMemHandle_v2", None) or cu.cuIpcOpenMemHandle
        opener.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
        assert opener(ctypes.byref(ptr), handle, 1) == 0          # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    Path(ready, role).write_text(str(os.getpid()))
    while not Path(stop).exists():
        if role == "importer" and Path(check).exists():
            Path(check).unlink()
            buf = (ctypes.c_ubyte * 16)()
            rc = cu.cuMemcpyDtoH_v2(buf, ptr, ctypes.c_size_t(16))
            Path(ready, "importer-sum").write_text(f"rc={rc} bytes={bytes(buf).hex()}")
        time.sleep(0.1)


# ---- what /proc shows --------------------------------------------------------------------------------------
def view(pid: int) -> dict:
    maps = [" ".join(p) for p in procfs.maps(pid) if len(p) == 6 and p[5].startswith(("/dev/nvidia", "/dev/shm"))]
    fds = {}
    for fd in procfs.fds(pid):
        try:
            link = procfs.fd_link(pid, fd)
            fds[fd] = link + (f" ino={procfs.fd_stat(pid, fd).st_ino}" if link.startswith("/dev/shm") else "")
        except OSError:
            continue
    env = {k: v for k, v in procfs.environ(pid).items() if k.startswith(("CUDA_", "NCCL_"))}
    return {"pid": pid, "comm": procfs.comm(pid), "maps": maps, "fds": fds, "env": env}


def shared_files(a: int, b: int) -> list[str]:
    def held(pid: int) -> dict[tuple[str, str], str]:
        out = {(p[3], p[4]): p[5] for p in procfs.maps(pid) if len(p) == 6 and p[4] != "0"}
        for fd in procfs.fds(pid):
            try:
                st = procfs.fd_stat(pid, fd)
                out[(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino))] = procfs.fd_link(pid, fd)
            except OSError:
                continue
        return out
    ha, hb = held(a), held(b)
    return sorted({ha[k] for k in ha.keys() & hb.keys() if not ha[k].startswith(("/usr", "/lib", "/opt", "/proc"))})


def driver(pid: int, *ops: str, timeout: float = 60) -> list[dict]:
    """tests/gpu/driver_ops.py in a child: a hung call is killed at `timeout` and reported as a hang."""
    try:
        out = subprocess.run([sys.executable, str(HERE / "driver_ops.py"), str(pid), *ops], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"op": " ".join(ops), "hang": timeout}]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")] or \
        [{"op": " ".join(ops), "rc": out.returncode, "stderr": out.stderr[-400:]}]


def probe(case: str, pair: tuple[int, int], work: Path) -> None:
    exporter, importer = pair
    for pid in pair:
        say(f"proc {case}", view(pid))
    say(f"mps {case}", [p for p in procfs.pids() if procfs.exe(p).endswith(("nvidia-cuda-mps-control",
                                                                              "nvidia-cuda-mps-server"))])
    shares = ipc_peers.shares(list(pair))
    say(f"check {case}", {"shares": [s.__dict__ for s in shares],
                          "reasons": unsupported_reasons(list(pair), release=release())})
    both = any(set(s.pids) == set(pair) for s in shares)
    print(f"VERDICT {case} {'prefix-holds' if both else 'prefix-missing'}", flush=True)
    if not both:
        say(f"shared_files {case}", shared_files(exporter, importer))
    steps: list[dict] = []
    for pid in pair:
        steps += driver(pid, "state", "lock:2000", timeout=30)
    for pid in pair:
        steps += driver(pid, "checkpoint", "state")
    for pid in pair:
        steps += driver(pid, "state", "restore", "unlock", "state")
    say(f"driver {case}", steps)
    check = work / "check"
    check.touch()
    time.sleep(3)
    say(f"data {case}", {p.name: p.read_text() for p in (work / "ready").glob("*-sum")})


def wait_ready(ready: Path, names: tuple[str, str], procs: list) -> tuple[int, int]:
    deadline = time.monotonic() + 180
    while not all((ready / n).exists() for n in names):
        if time.monotonic() > deadline or any(p.poll() is not None if hasattr(p, "poll") else p.exitcode is not None
                                              for p in procs):
            raise RuntimeError(f"pair not ready: {sorted(x.name for x in ready.iterdir())}")
        time.sleep(0.1)
    return int((ready / names[0]).read_text()), int((ready / names[1]).read_text())


def run_case(case: str, work: Path) -> None:
    work = work / case
    (work / "ready").mkdir(parents=True, exist_ok=True)
    stop, check = work / "stop", work / "check"
    procs: list = []
    try:
        if case == "torch":
            import torch.multiprocessing as mp
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            procs = [ctx.Process(target=torch_learner, args=(q, str(work / "ready"), str(stop))),
                     ctx.Process(target=torch_actor, args=(q, str(work / "ready"), str(stop), str(check)))]
            for p in procs:
                p.start()
            pair = wait_ready(work / "ready", ("learner", "actor"), procs)
        else:
            procs = [subprocess.Popen([sys.executable, __file__, "--role", role, str(work / "ready"), str(stop),
                                       str(check)]) for role in ("exporter", "importer")]
            pair = wait_ready(work / "ready", ("exporter", "importer"), procs)
        probe(case, pair, work)
    except Exception as e:  # noqa: BLE001 - a probe reports and goes on to the next case
        say(f"error {case}", repr(e))
    finally:
        stop.touch()
        time.sleep(1)
        for p in procs:
            pid = p.pid
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass


def main() -> int:
    if sys.argv[1:2] == ["--role"]:
        raw_role(*sys.argv[2:6])
        return 0
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    say("driver_release", release())
    for case in sys.argv[2:] or ["torch", "raw"]:
        run_case(case, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
