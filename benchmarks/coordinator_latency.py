"""Barrier + commit latency of the real Coordinator (slurmckpt.coordinator.server) against N simulated ranks.

Each size runs in a fresh coordinator process (so its RSS delta is its own); that process starts one client
process holding N real TCP connections on loopback. Every simulated rank speaks the real protocol
(challenge -> hello -> welcome, HMAC-sealed lines via protocol.Sealer, each received line verified) and answers
prepare/capture/resume instantly; the client is a plain epoll loop, as cheap as the protocol allows, since on
this host it shares the CPUs the coordinator runs on (its CPU per epoch is reported too).
Measured: Coordinator.run_epoch()['total_s'] (PREPARE..all READY..CAPTURE..all CAPTURED..COMMIT..RESUME..all
DONE), also cut_s / commit_s, over --epochs epochs after --warmup; committer = no-op or a real
JobStore.commit in a temp dir (each rank's rank.json pre-written, so commit reads N rank manifests, writes
and fsyncs the job manifest, prunes the epoch that falls out of keep=2).

    /opt/slurmckpt/venv/bin/python benchmarks/coordinator_latency.py [--sizes 1,64,256,1024] [--epochs 10]
        [--profile 1024]   # also cProfile the coordinator process at that size (top functions in the report)
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import resource
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

from slurmckpt.coordinator.client import REPLIES  # noqa: E402
from slurmckpt.coordinator.protocol import LineReader, Sealer, encode_prefix, new_token, parse_line  # noqa: E402
from slurmckpt.coordinator.server import Coordinator  # noqa: E402
from slurmckpt.store.jobstore import JobStore  # noqa: E402

TARGET_S = 0.050


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_s(pid: int) -> float:
    """CPU time of a (single-threaded) process, in ns resolution (/proc/PID/stat ticks are 10 ms)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- simulated ranks (client process) ------------------------------------------------------------------
# The ranks share one process and the host's CPUs with the coordinator, while real ranks each have a node of
# their own: they are kept as cheap as the protocol allows, so that what is measured is the coordinator. One
# plain epoll loop over non-blocking sockets (no asyncio, no task or transport per rank), one shared read
# buffer, each reply's JSON encoded once per epoch for all ranks. Every line is still authenticated both ways
# with the real protocol.Sealer.
class SimRank:
    replies: dict[tuple[str, int], bytes] = {}          # (command, epoch) -> encoded reply prefix

    def __init__(self, i: int, sock: socket.socket, token: str) -> None:
        self.i, self.sock, self.token = i, sock, token
        self.lines = LineReader()
        self.out = self.peer = None
        self.welcomed = False

    def send(self, data: bytes) -> None:
        if self.sock.send(data) != len(data):          # a ~100-byte line into an idle socket: never partial
            raise SystemExit("short send")

    def received(self, data: memoryview) -> bool:
        """Handle what one read brought; True when this rank was just welcomed."""
        welcomed = False
        for line in self.lines.feed(data):
            if self.peer is None:                      # challenge -> hello
                nonce = parse_line(line)["nonce"]
                self.out, self.peer = Sealer(self.token, nonce), Sealer(self.token, nonce)
                self.send(self.out.seal({"type": "hello", "rank": f"0.{self.i}", "node": "sim", "interval": 0}))
                continue
            msg = self.peer.open(line)
            kind = msg["type"]
            if not self.welcomed:
                if kind != "welcome":
                    raise SystemExit("coordinator refused hello")
                self.welcomed = welcomed = True
            elif kind in REPLIES:
                key = (kind, msg["epoch"])
                prefix = self.replies.get(key)
                if prefix is None:
                    reply = {"type": REPLIES[kind], "epoch": msg["epoch"]}
                    if kind == "capture":
                        reply.update(kind="image", bytes=0)
                    prefix = self.replies[key] = encode_prefix(reply)
                self.send(self.out.seal_prefix(prefix))
        return welcomed


def client_main(port: int, token: str, n: int) -> None:
    poller, ranks, buf = select.epoll(), {}, memoryview(bytearray(256 * 1024))
    joined = 0

    def serve(timeout: float) -> None:
        nonlocal joined
        for fd, _ in poller.poll(timeout):
            rank = ranks[fd]
            try:
                got = rank.sock.recv_into(buf)
            except BlockingIOError:
                continue
            except ConnectionError:
                got = 0
            if not got:                                # the coordinator went away: so do we
                raise SystemExit(0)
            joined += rank.received(buf[:got])

    for start in range(0, n, 64):                      # connect in batches: listen backlog
        for i in range(start, min(n, start + 64)):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ranks[sock.fileno()] = SimRank(i, sock, token)
            poller.register(sock.fileno(), select.EPOLLIN)
        deadline = time.monotonic() + 30
        while joined < min(n, start + 64):
            if time.monotonic() > deadline:
                raise SystemExit(f"only {joined}/{n} ranks welcomed")
            serve(1.0)
    print("joined", flush=True)
    while True:
        serve(-1)


# ---- coordinator process -------------------------------------------------------------------------------
def make_committer(kind: str, n: int, epochs: int, tmp: Path):
    if kind == "noop":
        return lambda epoch, records, reason: None, None
    store = JobStore(tmp / "images", "bench", 4242)
    store.ensure()
    for epoch in range(1, epochs + 1):     # what each rank's capture would have left: a complete rank.json
        for i in range(n):
            d = store.rank_dir(epoch, "0", i)
            d.mkdir(parents=True)
            (d / "rank.json").write_text('{"kind":"image","files":{}}')

    def commit(epoch: int, records: dict, reason: str) -> None:
        store.commit(epoch, records, reason, keep=2)
    return commit, store


async def serve_main(n: int, epochs: int, warmup: int, committer_kind: str, profile: bool) -> dict:
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="coordbench-"))
    try:
        committer, _ = make_committer(committer_kind, n, epochs + warmup, tmp)
        rss0 = rss_bytes()
        token = new_token()
        coord = Coordinator(token, committer, next_epoch=1)
        port = await coord.start("127.0.0.1", 0)
        client = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", "--port", str(port), "--token", token, "--ranks", str(n),
            stdout=asyncio.subprocess.PIPE)
        line = await asyncio.wait_for(client.stdout.readline(), 120)
        if line.strip() != b"joined":
            raise SystemExit(f"client failed: {line!r}")
        deadline = time.monotonic() + 30
        while len(coord.ranks) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(coord.ranks)}/{n} ranks registered")
            await asyncio.sleep(0.01)
        rss1 = rss_bytes()
        for _ in range(warmup):
            r = await coord.run_epoch("warmup", False)
            assert r["status"] == "committed", r
        results, cpu, sim_cpu = [], [], []
        prof = cProfile.Profile() if profile else None
        for _ in range(epochs):
            c0, s0 = time.process_time(), cpu_s(client.pid)
            if prof:
                prof.enable()
            r = await coord.run_epoch("bench", False)
            if prof:
                prof.disable()
            cpu.append(time.process_time() - c0)
            sim_cpu.append(cpu_s(client.pid) - s0)
            assert r["status"] == "committed", r
            assert r["ranks"] == n
            results.append(r)
            await asyncio.sleep(0.02)
        rss2 = rss_bytes()
        await coord.stop()
        client.kill()
        await client.wait()
        out = {"ranks": n, "committer": committer_kind, "total": [r["total_s"] for r in results],
               "cut": [r["cut_s"] for r in results], "commit": [r["commit_s"] for r in results], "cpu": cpu,
               "sim_cpu": sim_cpu,
               "rss_before": rss0, "rss_connected": rss1, "rss_after": rss2}
        if prof:
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(22)
            st.sort_stats("cumulative").print_stats(25)
            out["profile"] = s.getvalue()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- driver --------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def run_one(n: int, committer: str, epochs: int, warmup: int, profile: bool) -> dict:
    cmd = [sys.executable, __file__, "--serve", "--ranks", str(n), "--committer", committer,
           "--epochs", str(epochs), "--warmup", str(warmup)] + (["--profile-this"] if profile else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"})
    if p.returncode != 0:
        raise SystemExit(f"size {n} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,64,256,1024")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--committers", default="noop,store")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the coordinator at this size (noop)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "coordinator-latency.txt")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-this", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int)
    ap.add_argument("--token")
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--committer", default="noop")
    a = ap.parse_args()
    if a.client:
        raise_nofile()
        client_main(a.port, a.token, a.ranks)
        return
    if a.serve:
        print(json.dumps(asyncio.run(serve_main(a.ranks, a.epochs, a.warmup, a.committer, a.profile_this))))
        return

    lines = [f"Coordinator run_epoch latency, loopback TCP, simulated ranks answering instantly (one epoll "
             f"client process), {a.epochs} epochs after {a.warmup} warm-up, fresh coordinator process per row",
             f"host: {os.uname().nodename} kernel {os.uname().release}, {os.cpu_count()} CPUs, "
             f"python {sys.version.split()[0]}; {time.strftime('%Y-%m-%d %H:%M:%S')}",
             "total = PREPARE..READY..CAPTURE..CAPTURED..COMMIT..RESUME..DONE; cut = all READY; "
             "cpu = coordinator process CPU per epoch; sim cpu = the simulated ranks' process CPU per epoch; "
             "RSS delta = after N connections+epochs minus before listen",
             "",
             f"{'ranks':>6} {'committer':<9} {'total med ms':>12} {'total p95 ms':>12} {'cut med ms':>10} "
             f"{'commit med ms':>13} {'cpu med ms':>10} {'sim cpu ms':>10} {'RSS delta MiB':>13} {'per rank KiB':>12}"]
    print("\n".join(lines), flush=True)
    rows = []
    for committer in a.committers.split(","):
        for n in [int(x) for x in a.sizes.split(",")]:
            r = run_one(n, committer, a.epochs, a.warmup, False)
            rows.append(r)
            delta = r["rss_after"] - r["rss_before"]
            line = (f"{n:>6} {committer:<9} {statistics.median(r['total']) * 1e3:12.1f} "
                    f"{pct(r['total'], 0.95) * 1e3:12.1f} {statistics.median(r['cut']) * 1e3:10.1f} "
                    f"{statistics.median(r['commit']) * 1e3:13.1f} {statistics.median(r['cpu']) * 1e3:10.1f} "
                    f"{statistics.median(r['sim_cpu']) * 1e3:10.1f} "
                    f"{delta / 2**20:13.1f} {delta / 1024 / n:12.1f}")
            lines.append(line)
            print(line, flush=True)
    big = [r for r in rows if r["ranks"] == max(x["ranks"] for x in rows)]
    verdict = ", ".join(f"{r['committer']}: {statistics.median(r['total']) * 1e3:.1f} ms "
                        f"({'OK' if statistics.median(r['total']) <= TARGET_S else 'MISS'})" for r in big)
    lines += ["", f"target <= {TARGET_S * 1e3:.0f} ms at {big[0]['ranks']} ranks: {verdict}"]
    if a.profile:
        r = run_one(a.profile, "noop", a.epochs, a.warmup, True)
        lines += ["", f"cProfile of the coordinator process, {a.profile} ranks, noop committer, {a.epochs} epochs "
                  f"(profiled total median {statistics.median(r['total']) * 1e3:.1f} ms):", r["profile"]]
    text = "\n".join(lines) + "\n"
    print(text[text.index("target"):])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)


if __name__ == "__main__":
    main()
