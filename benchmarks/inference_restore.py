"""Inference server (tests/gpu/inference_server.py) on the device machine, root: restore-to-serving against its
real cold start, both reading from the disk (the page cache is emptied before each).

  cold     spawn a fresh server (imports, from_pretrained of fp16 safetensors to cuda, warm-up, listen) ->
           a client's first `GEN` answered; the server's own SERVING time and its phases beside it
  restore  one server, started once, warmed and having answered, in the host PID namespace: GPU lock +
           checkpoint (slurmckpt.cuda TreeGpuStage), criu dump to local disk (the process ends), sync, caches
           dropped -> criu restore + GPU restore + unlock -> a client's first `GEN` answered
  floors   the driver's GPU restore alone (restore_all), the disk's read of the image bytes, and for cold the
           disk's read of the weights file (each read back once with the page cache emptied)

Every server must give the same tokens for the same prompt ids (before the first dump, after each restore,
each cold server): MATCH, or MISMATCH and exit 1. Cycles run in --order (default: cold,restore per pair).
One JSON line per measurement as it goes, then a summary; --out keeps them all.

    python3 benchmarks/inference_restore.py --pairs 3 --size gpt2-large --work /var/tmp/infer --out infer.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import harness  # noqa: E402
from slurmckpt.cuda.driver import load_driver  # noqa: E402
from slurmckpt.cuda.remap import build_pairs, visible_gpus  # noqa: E402
from slurmckpt.cuda.stage import TreeGpuStage  # noqa: E402

SERVER = REPO / "tests" / "gpu" / "inference_server.py"
SIZES = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
         "gpt2-xl": (48, 1600, 25)}                                   # (n_layer, n_embd, n_head), vocab 50257
PHASE = re.compile(r"^PHASE (\w+) ([\d.]+) at ([\d.]+)$", re.M)


def read_back(files: list[Path]) -> tuple[int, float]:
    """Bytes and seconds to read `files` from the disk (page cache emptied first): what any restore of them
    must at least wait for. The page cache is left holding them: the caller empties it again."""
    harness.drop_caches()
    buf, total = bytearray(16 << 20), 0
    t = time.monotonic()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total, time.monotonic() - t


def files_in(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file())


def ask(port: int, prompt_id: int, n: int, timeout: float = 120) -> list[int]:
    """One request on its own connection; the client closes first (see inference_server.serve)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GEN {prompt_id} {n}\n".encode())
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    parts = buf.decode(errors="replace").split()
    if parts[:2] != ["OK", str(prompt_id)] or len(parts) != n + 2:
        raise RuntimeError(f"GEN {prompt_id} {n} answered {buf[:300]!r}")
    return [int(x) for x in parts[2:]]


def wait_port(w: harness.Workload, port_file: Path, timeout: float = 300) -> int:
    """The port, as soon as the server has written it (it listens before it writes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_file.exists():
            return int(port_file.read_text())
        if not w.alive():
            raise RuntimeError(f"server exited before listening:\n{w.text()[-3000:]}")
        time.sleep(0.001)
    raise TimeoutError(f"no port file within {timeout}s:\n{w.text()[-3000:]}")


def wait_idle(port: int, timeout: float = 10) -> None:
    """Until the server holds no TCP socket on its port but the listener (/proc/net/tcp, host network
    namespace): the dump then has no connection to carry."""
    hexport = f"{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [ln.split() for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        busy = [r for r in rows if r[1].endswith(":" + hexport) and r[3] != "0A"]     # 0A: LISTEN
        if not busy:
            return
        time.sleep(0.005)
    raise TimeoutError(f"connections still open on port {port}: {busy}")


class Bench:
    """One run: the weights, the restored server, every record, the reference answers."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.weights = a.work / "weights"            # kept between runs: made once for a shape
        self.run = harness.fresh_dir(a.work / "run")  # logs, port files, images of this run
        self.ids = list(range(1, a.prompts + 1))
        self.env = {"PYTHONUNBUFFERED": "1"}
        self.records: list[dict] = []
        self.reference: list[list[int]] | None = None
        self.driver = load_driver()

    def emit(self, rec: dict) -> None:
        rec = {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}
        self.records.append(rec)
        print(json.dumps(rec), flush=True)
        self.save()

    def save(self, summary: dict | None = None) -> None:
        if self.a.out:
            tmp = self.a.out.with_suffix(".tmp")
            tmp.write_text(json.dumps({"config": self.config(), "records": self.records, "summary": summary},
                                      indent=1))
            tmp.rename(self.a.out)

    def config(self) -> dict:
        a = self.a
        return {"size": a.size, "layers": a.layers, "embd": a.embd, "heads": a.heads, "order": a.order,
                "tokens": a.tokens, "prompt_len": a.prompt_len, "prompt_ids": self.ids, "work": str(a.work)}

    def server_argv(self, port_file: Path) -> list[str]:
        return [sys.executable, str(SERVER), "--weights", str(self.weights), "--port-file", str(port_file),
                "--warmup-n", str(self.a.tokens), "--prompt-len", str(self.a.prompt_len)]

    def make_weights(self) -> None:
        a, cfg = self.a, self.weights / "config.json"
        shape = (a.layers, a.embd, a.heads)
        if cfg.exists() and tuple(json.loads(cfg.read_text()).get(k) for k in ("n_layer", "n_embd", "n_head")) == shape:
            print(json.dumps({"weights": str(self.weights), "made": False}), flush=True)     # made by an earlier run
            return
        harness.fresh_dir(self.weights)
        p = subprocess.run([sys.executable, str(SERVER), "--make-weights", str(self.weights), "--layers",
                            str(a.layers), "--embd", str(a.embd), "--heads", str(a.heads)],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"--make-weights rc={p.returncode}:\n{p.stdout[-1500:]}{p.stderr[-3000:]}")
        print(json.dumps({"weights": str(self.weights), "made": True, "line": p.stdout.strip()[-300:]}),
              flush=True)

    def check(self, kind: str, answers: list[list[int]]) -> bool:
        ok = answers == self.reference
        print(f"{'MATCH' if ok else 'MISMATCH'}: {kind}: prompt ids {self.ids}"
              + ("" if ok else f"\n  got {answers}\n  ref {self.reference}"), flush=True)
        return ok

    def start_server(self) -> tuple[harness.Workload, int]:
        """The server to be checkpointed: started once, warmed, the reference answers taken from it."""
        port_file = self.run / "server.port"
        w = harness.Workload(self.server_argv(port_file), self.run / "server.log", env=self.env)
        port = wait_port(w, port_file)
        self.reference = [ask(port, p, self.a.tokens) for p in self.ids]
        print(json.dumps({"server": w.pid, "port": port, "startup": w.text().strip().splitlines()[-1]}),
              flush=True)
        return w, port

    def cold(self, pair: int) -> None:
        weight_bytes, weight_read = read_back(files_in(self.weights))
        harness.drop_caches()
        port_file = self.run / f"cold{pair}.port"
        t0 = time.monotonic()
        w = harness.Workload(self.server_argv(port_file), self.run / f"cold{pair}.log", env=self.env)
        try:
            port = wait_port(w, port_file)
            first = ask(port, self.ids[0], self.a.tokens)
            answered = time.monotonic() - t0
            answers = [first] + [ask(port, p, self.a.tokens) for p in self.ids[1:]]
            text = w.text()
        finally:
            w.kill()
        serving = re.search(r"^SERVING ([\d.]+)$", text, re.M)
        phases = {m.group(1): float(m.group(2)) for m in PHASE.finditer(text)}
        self.emit({"kind": "cold", "pair": pair, "cold_to_answer_s": answered,
                   "serving_line_s": float(serving.group(1)) if serving else None,
                   **{f"{k}_s": v for k, v in phases.items()},
                   "weights_bytes": weight_bytes, "weights_read_s": weight_read,
                   "match": self.check(f"cold {pair}", answers)})

    def restore(self, pair: int, w: harness.Workload, port: int) -> None:
        images = harness.fresh_dir(self.run / "images")
        wait_idle(port)
        t0 = time.monotonic()
        record = harness.gpu_checkpoint(w.tree())
        t1 = time.monotonic()
        harness.dump(w.pid, images)
        t2 = time.monotonic()
        w.reap_after_dump()
        os.sync()             # the images on the disk, as after a requeue: the restore reads them from there
        image_bytes, image_read = read_back(files_in(images))
        harness.drop_caches()
        t3 = time.monotonic()
        pid, _ = harness.restore(images)
        t4 = time.monotonic()
        w.adopt(pid)
        restored = TreeGpuStage.adopt_restored(self.driver, record, harness.proctree.descendants(pid))
        pairs = build_pairs(restored.gpus, visible_gpus(self.driver.devices(), record["cuda_visible_devices"]))
        t5 = time.monotonic()
        restored.restore_all(pairs)
        t6 = time.monotonic()
        restored.unlock_all()
        t7 = time.monotonic()
        first = ask(port, self.ids[0], self.a.tokens)
        t8 = time.monotonic()
        answers = [first] + [ask(port, p, self.a.tokens) for p in self.ids[1:]]
        shutil.rmtree(images, ignore_errors=True)     # kept when anything above failed
        self.emit({"kind": "restore", "pair": pair, "restore_to_answer_s": t8 - t3, "criu_restore_s": t4 - t3,
                   "gpu_restore_stage_s": t7 - t4, "gpu_restore_driver_s": t6 - t5, "gpu_unlock_s": t7 - t6,
                   "to_first_answer_s": t8 - t7, "gpu_lock_ckpt_s": t1 - t0, "criu_dump_s": t2 - t1,
                   "image_bytes": image_bytes, "image_read_s": image_read,
                   "match": self.check(f"restore {pair}", answers)})

    def summary(self) -> dict:
        def of(kind: str, key: str) -> list[float]:
            return [r[key] for r in self.records if r["kind"] == kind and r.get(key) is not None]

        def mmm(xs: list[float]) -> dict:
            return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)} if xs else {}

        cold = {r["pair"]: r["cold_to_answer_s"] for r in self.records if r["kind"] == "cold"}
        ratios = [r["restore_to_answer_s"] / cold[r["pair"]] for r in self.records
                  if r["kind"] == "restore" and r["pair"] in cold]
        split = {"restore": ("criu_restore_s", "gpu_restore_stage_s", "gpu_restore_driver_s", "to_first_answer_s",
                             "image_read_s", "image_bytes"),
                 "cold": ("serving_line_s", "python_s", "imports_s", "weights_s", "warmup_s", "weights_read_s",
                          "weights_bytes")}
        med = {k: statistics.median(of(kind, k)) if of(kind, k) else None for kind, ks in split.items() for k in ks}
        return {"restore_to_answer_s": mmm(of("restore", "restore_to_answer_s")),
                "cold_to_answer_s": mmm(of("cold", "cold_to_answer_s")), "ratio_restore_over_cold": mmm(ratios),
                "ratios": [round(x, 3) for x in ratios], "medians": med,
                "answers": "MATCH" if all(r["match"] for r in self.records) else "MISMATCH"}


def report(s: dict) -> list[str]:
    def line(name: str, d: dict) -> str:
        return f"{name:<22} " + (f"min {d['min']:7.2f}  median {d['median']:7.2f}  max {d['max']:7.2f}  (n={d['n']})"
                                 if d else "-")
    m = {k: (v if v is not None else float("nan")) for k, v in s["medians"].items()}
    gib = 2 ** 30
    return [line("restore-to-answer s", s["restore_to_answer_s"]), line("cold-to-answer s", s["cold_to_answer_s"]),
            line("ratio restore/cold", s["ratio_restore_over_cold"]) + f"  per pair {s['ratios']}",
            f"floors (medians): restore >= GPU restore (driver) {m['gpu_restore_driver_s']:.2f} s + image read "
            f"{m['image_read_s']:.2f} s ({m['image_bytes'] / gib:.2f} GiB); cold >= weights read "
            f"{m['weights_read_s']:.2f} s ({m['weights_bytes'] / gib:.2f} GiB)",
            f"restore split (medians): criu restore {m['criu_restore_s']:.2f} s, GPU restore+unlock "
            f"{m['gpu_restore_stage_s']:.2f} s, to first answer {m['to_first_answer_s']:.2f} s",
            f"cold split (medians): python {m['python_s']:.2f} s, imports {m['imports_s']:.2f} s, weights "
            f"{m['weights_s']:.2f} s, warm-up {m['warmup_s']:.2f} s, SERVING at {m['serving_line_s']:.2f} s",
            f"answers: {s['answers']}"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3, help="cold,restore pairs (the default order)")
    ap.add_argument("--order", default="", help="comma-separated cold|restore (default: cold,restore x pairs)")
    ap.add_argument("--size", default="gpt2-large", choices=sorted(SIZES), help="model shape (fp16 bytes: "
                    "gpt2 0.25, medium 0.7, large 1.5, xl 3.1 GB)")
    ap.add_argument("--layers", type=int, help="override the size's n_layer")
    ap.add_argument("--embd", type=int, help="override the size's n_embd")
    ap.add_argument("--heads", type=int, help="override the size's n_head")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per request (and per warm-up call)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3, help="prompt ids compared between servers")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/slurmckpt-infer"), help="weights and images "
                    "(local disk)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    layers, embd, heads = SIZES[a.size]
    a.layers, a.embd, a.heads = a.layers or layers, a.embd or embd, a.heads or heads
    a.order = a.order.split(",") if a.order else ["cold", "restore"] * a.pairs
    if set(a.order) - {"cold", "restore"}:
        ap.error(f"--order: cold or restore, not {sorted(set(a.order) - {'cold', 'restore'})}")
    return a


def main() -> int:
    a = parse()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # `timeout` ends us: the finally kills the servers
    harness.set_subreaper()            # the restored server re-parents to us, as to the task's wrapper
    a.work.mkdir(parents=True, exist_ok=True)
    bench = Bench(a)
    bench.make_weights()
    print(json.dumps({"config": bench.config(), "page_cache": "dropped before every cold start and restore"}),
          flush=True)
    w = None
    try:
        if "restore" in a.order:
            w, port = bench.start_server()
        else:
            port_file = bench.run / "ref.port"                   # the reference answers from a server of its own
            ref = harness.Workload(bench.server_argv(port_file), bench.run / "ref.log", env=bench.env)
            try:
                bench.reference = [ask(wait_port(ref, port_file), p, a.tokens) for p in bench.ids]
            finally:
                ref.kill()
        seen = {"cold": 0, "restore": 0}
        for kind in a.order:
            if kind == "cold":
                bench.cold(seen[kind])
            else:
                bench.restore(seen[kind], w, port)
            seen[kind] += 1
    except BaseException:
        if w is not None:
            print(w.text()[-3000:], flush=True)
        raise
    finally:
        if w is not None:
            w.kill()
    s = bench.summary()
    bench.save(s)
    print(json.dumps({"summary": s}), flush=True)
    print("\nsummary:\n" + "\n".join(report(s)))
    return 0 if s["answers"] == "MATCH" else 1


if __name__ == "__main__":
    sys.exit(main())
