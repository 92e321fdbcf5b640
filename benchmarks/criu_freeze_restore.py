"""CRIU freeze/restore of a 1 GiB process: by hand vs. through slurmckpt's rank pipeline (run as root).

Workload: python holding 1 GiB of os.urandom bytes (incompressible, every page touched), run as the job
user (ckptuser1) under slurmckpt-init in its own PID namespace and session. Two ways, alternating, N reps:

  raw        `unshare --pid --fork setsid <launch.init_command(...)>`, then by hand
             `criu dump --leave-running` (freeze = criu's wall time: the tree runs again when it exits),
             kill the tree, `criu restore -d` (restore = criu's wall time: the tree runs when it exits).
             Same criu binary, same options (criu.COMMON, -v2 log) as slurmckpt.
  slurmckpt  the agent's own code in-process: launch.spawn_tree into a Freezer cgroup, RankPipeline
             (JobStore, Freezer, CriuDriver, PipelineGpu -> null stage, no CUDA in the tree);
             freeze = prepare + capture + resume (tree thawed again), commit timed separately;
             restore = pipeline.restore_rank (verify checksums + criu restore) until the tree runs.

Images go to local disk (--work); `sync` (untimed) before each timed phase so neither side pays the other's
write-back. Page cache stays warm for both restores. Per-stage timings come from the pipeline's `timings`
(as written to rank.json) plus wrappers around verify/checksum/criu.

    /opt/slurmckpt/venv/bin/python benchmarks/criu_freeze_restore.py [-n 3] [--mib 1024] [--out FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import grp
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

from slurmckpt import proctree  # noqa: E402
from slurmckpt import storage as storage_mod  # noqa: E402
from slurmckpt.config import Config  # noqa: E402
from slurmckpt.criu import COMMON, CriuDriver  # noqa: E402
from slurmckpt.cuda.stage import PipelineGpu  # noqa: E402
from slurmckpt.freezer import Freezer  # noqa: E402
from slurmckpt.launch import Credentials, init_command, init_home, spawn_tree  # noqa: E402
from slurmckpt.pipeline import RankPipeline, restore_rank  # noqa: E402
from slurmckpt.storage import JobStore  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36

WORKLOAD = r"""
import os, sys, time
data = os.urandom({nbytes})
with open({ready!r}, "w") as f:
    f.write(str(len(data)))
i = 0
while True:
    i += 1
    time.sleep(0.01)
"""


# ---- helpers ------------------------------------------------------------------------------------------
def creds_of(user: str) -> Credentials:
    pw = pwd.getpwnam(user)
    groups = tuple(os.getgrouplist(user, pw.pw_gid))
    return Credentials(pw.pw_uid, pw.pw_gid, groups, ())


def sync() -> None:
    os.sync()


def wait_ready(path: Path, timeout: float = 120) -> None:
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
    """The restored tree runs: every process alive and not stopped, the workload's RSS back in full."""
    time.sleep(0.3)
    pids = proctree.descendants(root)
    states = {}
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            states[pid] = f.read().rsplit(")", 1)[1].split()[0]
    if len(pids) < 2 or any(s in "ZTtXx" for s in states.values()):
        raise SystemExit(f"restored tree not running: {states}")
    rss = max(int(open(f"/proc/{p}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") for p in pids)
    if rss < expect_bytes:
        raise SystemExit(f"restored workload RSS {rss} < {expect_bytes}")


def kill_tree(root: int) -> None:
    try:
        os.kill(root, signal.SIGKILL)     # PID 1 of its namespace: the whole namespace dies
    except ProcessLookupError:
        pass
    try:
        os.waitpid(root, 0)               # our child: spawn_tree's init and restored roots re-parent to us
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
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def criu_cmd(criu: str, *args: str) -> list[str]:
    return [criu, *args]


# ---- the two ways --------------------------------------------------------------------------------------
def run_raw(cfg: Config, creds: Credentials, work: Path, rep: int, nbytes: int) -> dict:
    tag = f"raw{rep}"
    ready = Path(f"/tmp/ckbench-{os.getpid()}-{tag}.ready")
    ready.unlink(missing_ok=True)
    images = work / tag
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True, mode=0o700)
    code = WORKLOAD.format(nbytes=nbytes, ready=str(ready))
    argv = ["unshare", "--pid", "--fork", "setsid",
            *init_command(creds, cfg.init_path, ["/usr/bin/python3", "-c", code],
                         init_home(cfg.run_dir, f"bench.{tag}", creds))]
    devnull = os.open("/dev/null", os.O_RDWR)
    unshare = subprocess.Popen(argv, stdin=devnull, stdout=devnull, stderr=devnull, cwd="/tmp",
                               start_new_session=True)
    os.close(devnull)
    root = ns_init_of_unshare(unshare.pid)
    wait_ready(ready)
    sync()

    t = time.monotonic()
    p = subprocess.run(criu_cmd(cfg.criu_path, "dump", "-t", str(root), "-D", str(images), "-o", "dump.log",
                                "-v2", *COMMON, "--leave-running"), capture_output=True, text=True)
    freeze = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"raw dump failed: {p.stderr}\n{(images / 'dump.log').read_text()[-3000:]}")
    size = dir_bytes(images)

    os.kill(root, signal.SIGKILL)
    unshare.wait()
    reap_all()
    sync()

    pidfile = work / f"{tag}.pid"
    pidfile.unlink(missing_ok=True)
    t = time.monotonic()
    p = subprocess.run(criu_cmd(cfg.criu_path, "restore", "-D", str(images), "-o", "restore.log", "-v2", "-d",
                                "--pidfile", str(pidfile), *COMMON), capture_output=True, text=True)
    restore = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"raw restore failed: {p.stderr}\n{(images / 'restore.log').read_text()[-3000:]}")
    new_root = int(pidfile.read_text())
    assert_running(new_root, nbytes)
    kill_tree(new_root)
    ready.unlink(missing_ok=True)
    shutil.rmtree(images, ignore_errors=True)
    pidfile.unlink(missing_ok=True)
    shutil.rmtree(Path(cfg.run_dir) / f"bench.{tag}", ignore_errors=True)
    return {"way": "raw", "rep": rep, "freeze_s": freeze, "restore_s": restore, "image_bytes": size}


STAGE_TIMES: dict[str, float] = {}


class TimedStore(JobStore):
    """JobStore that records how long rank.json writing (checksums) and verification take."""

    def write_rank_manifest(self, epoch, step, rank, meta):
        t = time.monotonic()
        try:
            return super().write_rank_manifest(epoch, step, rank, meta)
        finally:
            STAGE_TIMES["seal.write_rank_manifest"] = time.monotonic() - t

    def verify_rank(self, epoch, step, rank):
        t = time.monotonic()
        try:
            return super().verify_rank(epoch, step, rank)
        finally:
            STAGE_TIMES["restore.verify"] = time.monotonic() - t


class TimedCriu(CriuDriver):
    def restore(self, *a, **kw):
        t = time.monotonic()
        try:
            return super().restore(*a, **kw)
        finally:
            STAGE_TIMES["restore.criu"] = time.monotonic() - t


_checksum_total = [0.0]
_orig_checksum = storage_mod.file_checksum


def _timed_checksum(path):
    t = time.monotonic()
    try:
        return _orig_checksum(path)
    finally:
        _checksum_total[0] += time.monotonic() - t


storage_mod.file_checksum = _timed_checksum


def run_slurmckpt(cfg: Config, creds: Credentials, work: Path, rep: int, nbytes: int) -> dict:
    STAGE_TIMES.clear()
    tag = f"ckpt{rep}"
    ready = Path(f"/tmp/ckbench-{os.getpid()}-{tag}.ready")
    ready.unlink(missing_ok=True)
    store = TimedStore(work / "store", "bench", 1000 + rep)
    store.ensure()
    freezer = Freezer.for_task(cfg.freezer_root, f"bench.{os.getpid()}.{tag}")
    devnull = os.open("/dev/null", os.O_RDWR)
    # stand-in for the task's wrapper, whose stdout/stderr the pipeline snapshots: same stdio as the task
    wrapper = subprocess.Popen(["sleep", "infinity"], stdin=devnull, stdout=devnull, stderr=devnull)
    pipe = RankPipeline(store, "0", 0, freezer, TimedCriu(cfg.criu_path, cfg.criu_extra_args, cfg.capture_timeout_s),
                        PipelineGpu(cfg.gpu_lock_timeout_ms), creds, wrapper_pid=wrapper.pid)
    code = WORKLOAD.format(nbytes=nbytes, ready=str(ready))
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    pipe.root_pid = spawn_tree(["/usr/bin/python3", "-c", code], env, "/tmp", [devnull] * 3, creds,
                               cfg.init_path, freezer, init_home(cfg.run_dir, f"bench.{tag}", creds))
    wait_ready(ready)
    sync()

    epoch = store.next_epoch()
    _checksum_total[0] = 0.0
    t = time.monotonic()
    prep = pipe.prepare(epoch)
    t_prep = time.monotonic() - t
    cap = pipe.capture(epoch, final=False)     # periodic: sealed after the thaw, in resume()
    t_cap = time.monotonic() - t - t_prep
    thawed_at: list[float] = []
    real_thaw = freezer.thaw

    def thaw_and_note() -> None:
        real_thaw()
        thawed_at.append(time.monotonic())

    object.__setattr__(freezer, "thaw", thaw_and_note)
    pipe.resume(epoch)
    object.__setattr__(freezer, "thaw", real_thaw)
    freeze = thawed_at[0] - t                 # the tree runs again here; the seal follows while it runs
    if freezer.state() != "THAWED":
        raise SystemExit(f"tree not thawed after resume: {freezer.state()}")
    seal_checksum = _checksum_total[0]
    t = time.monotonic()
    store.commit(epoch, {"0.0": {"kind": cap["kind"]}}, "bench", keep=2)
    commit = time.monotonic() - t
    timings = dict(store.read_rank_manifest(epoch, "0", 0)["timings"])
    timings.update(pipe.timings)          # + seal, which rank.json cannot hold (written inside seal)
    size = dir_bytes(store.rank_dir(epoch, "0", 0))
    t = time.monotonic()                  # what the seal/verify checksums would cost hashing via mmap
    for name in store.read_rank_manifest(epoch, "0", 0)["files"]:
        mmap_checksum(store.rank_dir(epoch, "0", 0) / name)
    alt_checksum = time.monotonic() - t

    kill_tree(pipe.root_pid)
    pipe.root_pid = None
    sync()

    _checksum_total[0] = 0.0
    t = time.monotonic()
    new_root, manifest = restore_rank(pipe, epoch, [devnull] * 3)
    restore = time.monotonic() - t
    verify_checksum = _checksum_total[0]
    assert new_root is not None and manifest["kind"] == "image"
    assert_running(new_root, nbytes)
    kill_tree(new_root)
    wrapper.kill()
    wrapper.wait()
    os.close(devnull)
    freezer.remove()
    ready.unlink(missing_ok=True)
    shutil.rmtree(store.job_dir, ignore_errors=True)
    shutil.rmtree(Path(cfg.run_dir) / f"bench.{tag}", ignore_errors=True)
    return {"way": "slurmckpt", "rep": rep, "freeze_s": freeze, "restore_s": restore, "image_bytes": size,
            "prepare_s": t_prep, "capture_s": t_cap, "resume_s": freeze - t_prep - t_cap, "commit_s": commit,
            "timings": timings, "seal_checksum_s": seal_checksum,
            "seal_manifest_s": STAGE_TIMES.get("seal.write_rank_manifest", 0.0),
            "verify_s": STAGE_TIMES.get("restore.verify", 0.0), "verify_checksum_s": verify_checksum,
            "restore_criu_s": STAGE_TIMES.get("restore.criu", 0.0), "mmap_checksum_s": alt_checksum}


def mmap_checksum(path: Path) -> str:
    """Same xxh3 as storage.file_checksum, hashed straight from the page cache (no read() copies)."""
    import mmap
    import xxhash
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_64().hexdigest()
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            return xxhash.xxh3_64(m).hexdigest()


# ---- report --------------------------------------------------------------------------------------------
def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(rows: list[dict], nbytes: int, args) -> str:
    raw = [r for r in rows if r["way"] == "raw"]
    ours = [r for r in rows if r["way"] == "slurmckpt"]
    out = []
    w = out.append
    w(f"CRIU freeze/restore, {nbytes / 2**30:.2f} GiB random anonymous memory, python workload as {args.user}, "
      f"own PID namespace, N={args.n} alternating after {args.warmup} untimed warm-up cycle(s) of each")
    w(f"host: {os.uname().nodename} kernel {os.uname().release}, {os.cpu_count()} CPUs; criu "
      f"{'.'.join(map(str, CriuDriver(Config.load().criu_path).version()))}; images on {args.work}; "
      f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    w("")
    w(f"{'rep':>3} {'way':<10} {'freeze s':>9} {'restore s':>10} {'image MiB':>10}")
    for r in rows:
        w(f"{r['rep']:>3} {r['way']:<10} {r['freeze_s']:9.3f} {r['restore_s']:10.3f} {r['image_bytes'] / 2**20:10.1f}")
    w("")
    fr, rr = med(ours, "freeze_s") / med(raw, "freeze_s"), med(ours, "restore_s") / med(raw, "restore_s")
    w(f"median   raw: freeze {med(raw, 'freeze_s'):.3f} s  restore {med(raw, 'restore_s'):.3f} s  "
      f"image {med(raw, 'image_bytes') / 2**20:.1f} MiB")
    w(f"median  ours: freeze {med(ours, 'freeze_s'):.3f} s  restore {med(ours, 'restore_s'):.3f} s  "
      f"image {med(ours, 'image_bytes') / 2**20:.1f} MiB")
    w(f"ratio slurmckpt/raw: freeze {fr:.2f}  restore {rr:.2f}   (target <= 1.10: "
      f"freeze {'OK' if fr <= 1.10 else 'MISS'}, restore {'OK' if rr <= 1.10 else 'MISS'})")
    w("")
    w("where slurmckpt's time goes (median over reps, seconds):")
    keys = sorted({k for r in ours for k in r["timings"]})
    for k in keys:
        w(f"  stage {k:<18} {statistics.median(r['timings'].get(k, 0.0) for r in ours):8.3f}")
    for k, label in [("prepare_s", "prepare (total)"), ("capture_s", "capture (total)"),
                     ("resume_s", "resume (thaw)"), ("seal_checksum_s", "  seal: xxh3 of images"),
                     ("seal_manifest_s", "  seal: rank.json total"), ("commit_s", "commit (not in freeze)"),
                     ("verify_s", "restore: verify_rank"), ("verify_checksum_s", "  verify: xxh3 of images"),
                     ("restore_criu_s", "restore: criu restore"),
                     ("mmap_checksum_s", "alt: xxh3 via mmap, all files")]:
        w(f"  {label:<24} {med(ours, k):8.3f}")
    dump_ours = statistics.median(r["timings"].get("criu_dump", 0.0) for r in ours)
    w("")
    w(f"freeze overhead vs raw: {med(ours, 'freeze_s') - med(raw, 'freeze_s'):+.3f} s; of which seal (checksums "
      f"+ fsync) {med(ours, 'seal_manifest_s'):.3f} s, criu dump itself ours {dump_ours:.3f} vs raw "
      f"{med(raw, 'freeze_s'):.3f} s")
    w(f"restore overhead vs raw: {med(ours, 'restore_s') - med(raw, 'restore_s'):+.3f} s; of which verify "
      f"{med(ours, 'verify_s'):.3f} s, criu restore itself ours {med(ours, 'restore_criu_s'):.3f} vs raw "
      f"{med(raw, 'restore_s'):.3f} s")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=1, help="untimed cycles of each way first")
    ap.add_argument("--user", default="ckptuser1")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/slurmckpt-bench"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "criu-1gib.txt")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (criu, PID namespaces, cgroup freezer)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("cannot become a child subreaper")
    cfg = Config.load()
    creds = creds_of(args.user)
    nbytes = args.mib << 20
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, mode=0o700)
    rows = []
    try:
        for _ in range(args.warmup):      # first touch of guest memory / fresh fs blocks: not measured
            run_raw(cfg, creds, args.work, 99, nbytes)
            run_slurmckpt(cfg, creds, args.work, 99, nbytes)
        for rep in range(args.n):
            order = (run_raw, run_slurmckpt) if rep % 2 == 0 else (run_slurmckpt, run_raw)
            for fn in order:
                r = fn(cfg, creds, args.work, rep, nbytes)
                print(f"# {r['way']} rep {rep}: freeze {r['freeze_s']:.3f}s restore {r['restore_s']:.3f}s "
                      f"image {r['image_bytes'] / 2**20:.1f} MiB"
                      + (f" dump {r['timings']['criu_dump']:.3f}s seal {r['timings']['seal']:.3f}s verify {r['verify_s']:.3f}s "
                         f"criu restore {r['restore_criu_s']:.3f}s" if "timings" in r else ""),
                      flush=True)
                rows.append(r)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    text = report(rows, nbytes, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
