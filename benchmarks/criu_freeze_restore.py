"""CPU process, N GiB: the stall and the restore of slurmckpt's rank engine vs raw CRIU (run as root, no Slurm).

Workload: a python process holding N GiB, run as the job user under slurmckpt-init in its own PID namespace.
`--data random` (incompressible: the worst case for compression) or `mixed` (1/4 random, 1/4 zero pages
written, 1/2 float64 arrays of smooth values: what a simulation's memory tends to look like). Two ways on
the same kind of process, paired and alternating (A B B A ...), after an untimed warm-up cycle of each:

  raw        `criu dump --leave-running` into the store directory (stall = criu's wall time; the tree runs
             again when it exits), `sync` of the images timed apart (what a durable image costs more), kill,
             `criu restore -d` from the store (restore = criu's wall time).
  slurmckpt  the agent's rank runner in-process (RankRunner over a RankContext with a real TaskCgroup, CriuDriver, JobStore, staging
             and zstd as configured by default): stall = freeze .. thaw (criu dumps into node-local staging);
             the persist (zstd, checksums, fsync, rank.json) runs after the thaw at nice 10 and is timed apart;
             restore = RankRunner.restore (RESTORE's table: unpack from the store into staging, verified, then criu restore).

Store and staging are on the same local disk (--work) unless --staging says otherwise. Before each restore
the images of both ways are evicted from the page cache (fadvise DONTNEED after a sync): a requeued job is
restored from images no longer cached, often on another node (--warm keeps them cached).

    python benchmarks/criu_freeze_restore.py [-n 5] [--mib 1024] [--data mixed] [--out FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

from slurmckpt.node import proctree  # noqa: E402
from slurmckpt.rank import fit  # noqa: E402
from slurmckpt.config import Config  # noqa: E402
from slurmckpt.criu.driver import COMMON, CriuDriver  # noqa: E402
from slurmckpt.cuda.rank_stage import CudaRankGpu  # noqa: E402
from slurmckpt.identity import TreeName  # noqa: E402
from slurmckpt.node.task_cgroup import TaskCgroup  # noqa: E402
from slurmckpt.node.launch import Credentials, env_memfd, init_command, init_home, spawn_tree  # noqa: E402
from slurmckpt.identity import RankName  # noqa: E402
from slurmckpt.node.packet_filter import Iptables  # noqa: E402
from slurmckpt.rank.context import RankContext  # noqa: E402
from slurmckpt.rank.runner import RankRunner  # noqa: E402
from slurmckpt.rank.images import StorePolicy  # noqa: E402
from slurmckpt.store.jobstore import JobStore  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36

WORKLOAD = r"""
import array, math, os, random, sys, time
n = {nbytes}
def noise(size, r=random.Random(1)):
    return b"".join(r.randbytes(min(64 << 20, size - i)) for i in range(0, size, 64 << 20))
if {mixed!r}:
    q = n // 4
    rnd = noise(q)
    zeros = bytearray(q)
    zeros[::4096] = bytes(len(range(0, q, 4096)))          # every page written: resident, as zeros
    block = array.array("d", (math.sin(i / 997.0) * 1e3 for i in range(1 << 19))).tobytes()   # 4 MiB
    smooth = bytearray(block * (2 * q // len(block)))
    data = [rnd, zeros, smooth]
else:
    data = [noise(n)]
with open({ready!r}, "w") as f:
    f.write(str(sum(len(d) for d in data)))
while True:
    time.sleep(0.01)
"""


# ---- helpers ------------------------------------------------------------------------------------------
def creds_of(user: str) -> Credentials:
    pw = pwd.getpwnam(user)
    return Credentials(pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(user, pw.pw_gid)), ())


def wait_ready(path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"workload did not become ready ({path})")
        time.sleep(0.05)


def ns_init_of_unshare(unshare_pid: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = proctree.children_map().get(unshare_pid, [])
        if kids:
            return kids[0]
        time.sleep(0.01)
    raise SystemExit("unshare did not fork the namespace init")


def assert_running(root: int, expect_bytes: int) -> None:
    """The restored tree runs: every process alive and not stopped, the workload's memory back in full."""
    time.sleep(0.3)
    pids = proctree.descendants(root)
    states = {}
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            states[pid] = f.read().rsplit(")", 1)[1].split()[0]
    if len(pids) < 2 or any(s in "ZTtXx" for s in states.values()):
        raise SystemExit(f"restored tree not running: {states}")
    if fit.tree_memory(pids) < expect_bytes:
        raise SystemExit(f"restored workload holds {fit.tree_memory(pids)} < {expect_bytes} bytes")


def kill_tree(root: int) -> None:
    try:
        os.kill(root, signal.SIGKILL)     # PID 1 of its namespace: the whole namespace dies
    except ProcessLookupError:
        pass
    try:
        os.waitpid(root, 0)
    except ChildProcessError:
        pass
    reap_all()


def reap_all() -> None:
    """We are a subreaper: collect zombies that re-parented to us, without waiting for live children."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.endswith(".log"))


def evict(path: Path) -> None:
    """Drop the files' pages from the page cache (clean pages only: sync first)."""
    os.sync()
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def workload(args, ready: Path) -> list[str]:
    code = WORKLOAD.format(nbytes=args.mib << 20, mixed=args.data == "mixed", ready=str(ready))
    return ["/usr/bin/python3", "-c", code]


# ---- the two ways --------------------------------------------------------------------------------------
def run_raw(cfg: Config, creds: Credentials, args, rep: int) -> dict:
    tag = f"raw{rep}"
    ready = Path(f"/tmp/ckbench-{os.getpid()}-{tag}.ready")
    ready.unlink(missing_ok=True)
    images = args.work / "store" / tag
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True, mode=0o700)
    env_fd = env_memfd({"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    argv = ["unshare", "--pid", "--fork", "setsid",
            *init_command(creds, cfg.init_path, workload(args, ready), init_home(cfg.run_dir, f"bench.{tag}", creds),
                          "/tmp", env_fd)]
    devnull = os.open("/dev/null", os.O_RDWR)
    unshare = subprocess.Popen(argv, stdin=devnull, stdout=devnull, stderr=devnull, cwd="/tmp",
                               start_new_session=True, pass_fds=[env_fd])
    os.close(devnull)
    os.close(env_fd)
    root = ns_init_of_unshare(unshare.pid)
    wait_ready(ready)
    os.sync()

    t = time.monotonic()
    p = subprocess.run([cfg.criu_path, "dump", "-t", str(root), "-D", str(images), "-o", "dump.log", "-v2",
                        *COMMON, "--leave-running"], capture_output=True, text=True)
    stall = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"raw dump failed: {p.stderr}\n{(images / 'dump.log').read_text()[-3000:]}")
    t = time.monotonic()
    os.sync()                                    # what making the raw images durable costs on top
    sync_s = time.monotonic() - t
    size = dir_bytes(images)
    os.kill(root, signal.SIGKILL)
    unshare.wait()
    reap_all()

    pidfile = args.work / f"{tag}.pid"
    pidfile.unlink(missing_ok=True)
    if not args.warm:
        evict(images)
    t = time.monotonic()
    p = subprocess.run([cfg.criu_path, "restore", "-D", str(images), "-o", "restore.log", "-v2", "-d",
                        "--pidfile", str(pidfile), *COMMON], capture_output=True, text=True)
    restore = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"raw restore failed: {p.stderr}\n{(images / 'restore.log').read_text()[-3000:]}")
    new_root = int(pidfile.read_text())
    assert_running(new_root, args.mib << 20)
    kill_tree(new_root)
    ready.unlink(missing_ok=True)
    shutil.rmtree(images, ignore_errors=True)
    pidfile.unlink(missing_ok=True)
    shutil.rmtree(Path(cfg.run_dir) / f"bench.{tag}", ignore_errors=True)
    return {"way": "raw", "rep": rep, "stall_s": stall, "sync_s": sync_s, "restore_s": restore,
            "raw_bytes": size, "stored_bytes": size}


MARKS: dict[str, float] = {}


class Timed(TaskCgroup):
    """The tree's cgroup, noting when it freezes and thaws (the stall the job sees)."""

    def freeze(self, timeout_s: float = 10.0) -> float:
        MARKS["frozen"] = time.monotonic()
        return super().freeze(timeout_s)

    def thaw(self) -> None:
        super().thaw()
        MARKS["thawed"] = time.monotonic()


def run_slurmckpt(cfg: Config, creds: Credentials, args, rep: int) -> dict:
    tag = f"ckpt{rep}"
    ready = Path(f"/tmp/ckbench-{os.getpid()}-{tag}.ready")
    ready.unlink(missing_ok=True)
    store = JobStore(args.work / "store", "bench", 1000 + rep)
    store.ensure()
    policy = StorePolicy.from_config(Config.from_mapping({"staging_dir": str(args.staging)}))
    base = TaskCgroup.for_task(cfg.freezer_root, TreeName(900000 + os.getpid() % 10000, "0", rep, 0))
    freezer = Timed(base.path, base.tree)
    MARKS.clear()
    devnull = os.open("/dev/null", os.O_RDWR)
    wrapper = subprocess.Popen(["sleep", "infinity"], stdin=devnull, stdout=devnull, stderr=devnull)
    ctx = RankContext(store, RankName("0", 0), freezer,
                      CriuDriver(cfg.criu_path, cfg.criu_extra_args, cfg.capture_timeout_s),
                      CudaRankGpu(cfg.gpu_lock_timeout_ms), creds, policy, Iptables(), wrapper.pid)
    pipe = RankRunner()
    try:
        return _capture_and_restore(args, rep, tag, ready, store, freezer, ctx, pipe, devnull, cfg)
    finally:                                     # also when a run fails: nothing of it stays behind
        if pipe.root_pid:
            kill_tree(pipe.root_pid)
        wrapper.kill()
        wrapper.wait()
        os.close(devnull)
        freezer.remove()
        ready.unlink(missing_ok=True)
        shutil.rmtree(store.job_dir, ignore_errors=True)
        shutil.rmtree(Path(cfg.run_dir) / f"bench.{tag}", ignore_errors=True)


def _capture_and_restore(args, rep, tag, ready, store, freezer, ctx, pipe, devnull, cfg) -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    root = spawn_tree(workload(args, ready), env, "/tmp", [devnull] * 3, ctx.creds, cfg.init_path, freezer,
                      init_home(cfg.run_dir, f"bench.{tag}", ctx.creds))
    pipe.started(replace(ctx, root_pid=root))
    wait_ready(ready)
    os.sync()

    epoch = store.allocate_epoch(1, 3600, "bench")
    pipe.prepare(epoch)
    cap = pipe.capture(epoch, final=False)
    pipe.resume(epoch)                         # thaw, then the persist at bounded priority
    done = time.monotonic()
    if freezer.state() != "THAWED":
        raise SystemExit(f"tree not thawed after resume: {freezer.state()}")
    stall = MARKS["thawed"] - MARKS["frozen"]
    persist = done - MARKS["thawed"]
    store.commit(epoch, {"0.0": {"kind": cap["kind"]}}, "bench", keep=2)
    m = store.read_rank_manifest(epoch, "0", 0)
    stored = sum(f["size"] for f in m["files"].values())
    raw = sum(f.get("raw_size", f["size"]) for f in m["files"].values())
    timings = dict(pipe.state.timings)

    kill_tree(root)
    os.sync()
    if not args.warm:
        evict(store.job_dir)
    t = time.monotonic()
    new_root, manifest = pipe.restore(ctx, epoch, [devnull] * 3)
    restore = time.monotonic() - t
    timings["unpack"] = pipe.state.timings.get("unpack", 0.0)
    assert new_root is not None and manifest["kind"] == "image"
    assert_running(new_root, args.mib << 20)
    kill_tree(new_root)
    pipe.started(ctx)                          # no tree left
    return {"way": "slurmckpt", "rep": rep, "stall_s": stall, "persist_s": persist, "restore_s": restore,
            "raw_bytes": raw, "stored_bytes": stored, "timings": timings}


# ---- report --------------------------------------------------------------------------------------------
def spread(values: list[float]) -> str:
    return f"{min(values):7.3f} {statistics.median(values):7.3f} {max(values):7.3f}"


def report(rows: list[dict], args, cfg: Config) -> str:
    raw = [r for r in rows if r["way"] == "raw"]
    ours = [r for r in rows if r["way"] == "slurmckpt"]
    pairs = list(zip(sorted(raw, key=lambda r: r["rep"]), sorted(ours, key=lambda r: r["rep"])))
    out: list[str] = []
    w = out.append
    w(f"CPU process {args.mib / 1024:.2f} GiB ({args.data}), python as {args.user} in its own PID namespace; "
      f"N={args.n} pairs alternating (raw first in even reps) after {args.warmup} untimed warm-up pair(s)")
    w(f"host: {os.uname().nodename} kernel {os.uname().release}, {os.cpu_count()} CPUs, "
      f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM; criu "
      f"{'.'.join(map(str, CriuDriver(cfg.criu_path).version()))}; store {args.work}, staging {args.staging}; "
      f"compression zstd level {cfg.compression_level}, {cfg.compression_threads} threads, persist nice "
      f"{cfg.persist_nice}; restores {'warm' if args.warm else 'cold (images evicted from the page cache)'}; "
      f"{time.strftime('%Y-%m-%d %H:%M:%S')}; load at start {args.load}")
    w("")
    w(f"{'rep':>3} {'way':<10} {'stall s':>8} {'restore s':>10} {'persist s':>10} {'sync s':>7} {'raw MiB':>8} "
      f"{'stored MiB':>10}")
    for r in sorted(rows, key=lambda r: (r["rep"], r["way"])):
        w(f"{r['rep']:>3} {r['way']:<10} {r['stall_s']:8.3f} {r['restore_s']:10.3f} {r.get('persist_s', 0):10.3f} "
          f"{r.get('sync_s', 0):7.3f} {r['raw_bytes'] / 2**20:8.1f} {r['stored_bytes'] / 2**20:10.1f}")
    w("")
    w(f"{'':<36} {'min':>7} {'median':>7} {'max':>7}")
    w(f"{'raw criu dump (stall) s':<36} {spread([r['stall_s'] for r in raw])}")
    w(f"{'raw criu dump + sync s':<36} {spread([r['stall_s'] + r['sync_s'] for r in raw])}")
    w(f"{'slurmckpt stall (freeze..thaw) s':<36} {spread([r['stall_s'] for r in ours])}")
    w(f"{'raw criu restore s':<36} {spread([r['restore_s'] for r in raw])}")
    w(f"{'slurmckpt restore s':<36} {spread([r['restore_s'] for r in ours])}")
    w(f"{'persist after the thaw s':<36} {spread([r['persist_s'] for r in ours])}")
    w(f"{'persist MB/s (raw bytes)':<36} {spread([r['raw_bytes'] / r['persist_s'] / 1e6 for r in ours])}")
    w("")
    w("ratios slurmckpt/raw, per pair (min median max):")
    w(f"  stall / raw dump          {spread([o['stall_s'] / r['stall_s'] for r, o in pairs])}   (goal <= 0.5)")
    w(f"  stall / (raw dump + sync) {spread([o['stall_s'] / (r['stall_s'] + r['sync_s']) for r, o in pairs])}")
    w(f"  restore / raw restore     {spread([o['restore_s'] / r['restore_s'] for r, o in pairs])}   (goal <= 1.0)")
    w(f"  stored / raw bytes        {spread([o['stored_bytes'] / o['raw_bytes'] for r, o in pairs])}")
    w("")
    w("slurmckpt stages (median s): " + ", ".join(
        f"{k} {statistics.median(r['timings'].get(k, 0.0) for r in ours):.3f}"
        for k in ("check", "space", "freeze", "criu_dump", "snapshot-output", "persist", "unpack")))
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--data", choices=("random", "mixed"), default="mixed")
    ap.add_argument("--warmup", type=int, default=1, help="untimed pairs first")
    ap.add_argument("--user", default="ckptuser1")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/slurmckpt-bench"))
    ap.add_argument("--warm", action="store_true", help="restore from cached images (no eviction)")
    ap.add_argument("--staging", type=Path, default=None, help="default: WORK/staging (same disk as the store)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.staging = args.staging or args.work / "staging"
    if os.geteuid() != 0:
        raise SystemExit("run as root (criu, PID namespaces, cgroup freezer)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("cannot become a child subreaper")
    cfg = Config()        # defaults: the installed layout (docs/contracts.md), not this host's admin file
    args.load = open("/proc/loadavg").read().split()[0]
    creds = creds_of(args.user)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, mode=0o700)
    rows = []
    try:
        for _ in range(args.warmup):      # first touch of memory / fresh fs blocks: not measured
            run_raw(cfg, creds, args, 99)
            run_slurmckpt(cfg, creds, args, 99)
        for rep in range(args.n):
            order = (run_raw, run_slurmckpt) if rep % 2 == 0 else (run_slurmckpt, run_raw)
            for fn in order:
                r = fn(cfg, creds, args, rep)
                print(f"# {r['way']} rep {rep}: stall {r['stall_s']:.3f}s restore {r['restore_s']:.3f}s "
                      f"persist {r.get('persist_s', 0):.3f}s stored {r['stored_bytes'] / 2**20:.1f} of "
                      f"{r['raw_bytes'] / 2**20:.1f} MiB", flush=True)
                rows.append(r)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
        shutil.rmtree(args.staging, ignore_errors=True)
    text = report(rows, args, cfg)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
