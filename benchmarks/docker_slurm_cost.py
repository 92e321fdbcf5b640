#!/usr/bin/env python3
"""What the docker-slurm CI test costs (tests/docker): docker-slurm/cluster.sh build, up, demo, down, timed
phase by phase in three conditions, interleaved (cold, warm, edited, cold, warm, edited, ...):

- cold:   no image of ours in the engine's store (base image debootstrap'ed again, every layer built);
- warm:   the store holds the image of this very tree (what a CI run on a kept machine meets);
- edited: the store holds the image of the tree before a one-line change of src/ (a new commit).

Each run works in a fresh copy of the tree (tracked and untracked files, as a clone has them), as CI does.
The CRIU binary comes from --criu-cache (a directory holding criu-VERSION-pPATCHID/criu, as setup.sh's
/var/cache/slurmckpt does in CI); without it every cold run also builds CRIU in a container.

    benchmarks/docker_slurm_cost.py [--reps 3] [--criu-cache DIR] [--out benchmarks/results/docker-slurm-cost.txt]
Needs root and podman (or Docker), like the test.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("build", "up", "demo", "down")
LABEL = "org.slurmckpt.docker-slurm=1"
BASE = "localhost/slurmckpt/debian:bookworm"


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                           check=True, capture_output=True).stdout
    subprocess.run(["tar", "-C", str(REPO), "--null", "-T", "-", "-c", "-f", "-"], input=files, check=True,
                   stdout=open(dest / "tree.tar", "wb"))
    (dest / "tree").mkdir()
    subprocess.run(["tar", "-C", str(dest / "tree"), "-x", "-f", str(dest / "tree.tar")], check=True)


def engine() -> str:
    return "docker" if os.environ.get("SLURMCKPT_ENGINE") == "docker" else "podman"


def forget_images() -> None:
    """Every image of ours, the base included: the next build starts from nothing."""
    ids = subprocess.run([engine(), "images", "-a", "-q", "--filter", f"label={LABEL}"],
                         capture_output=True, text=True).stdout.split()
    subprocess.run([engine(), "rmi", "-f", *sorted(set(ids)), BASE], capture_output=True)


def run_cluster(tree: Path, criu_cache: Path | None, phases: tuple[str, ...] = PHASES) -> dict[str, float]:
    cache = tree / "docker-slurm" / ".build" / "cache"
    if criu_cache is not None and not cache.exists():
        shutil.copytree(criu_cache, cache, symlinks=True)
    times = {}
    for phase in phases:
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(tree / "docker-slurm" / "cluster.sh"), phase], capture_output=True, text=True)
        times[phase] = time.monotonic() - t0
        if r.returncode != 0 or (phase == "demo" and "DEMO OK" not in r.stdout):
            subprocess.run(["bash", str(tree / "docker-slurm" / "cluster.sh"), "down"], capture_output=True)
            raise SystemExit(f"cluster.sh {phase} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    times["total"] = sum(times.values())
    return times


def one(condition: str, criu_cache: Path | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="docker-slurm-cost.") as tmp:
        tmp_path = Path(tmp)
        copy_tree(tmp_path)
        tree = tmp_path / "tree"
        if condition == "cold":
            forget_images()
        else:
            run_cluster(tree, criu_cache, ("build",))     # the image of this tree is in the store now
            shutil.rmtree(tree / "docker-slurm" / ".build")
            if condition == "edited":
                init = tree / "src" / "slurmckpt" / "__init__.py"
                init.write_text(init.read_text() + f"# edited {time.time()}\n")
        return run_cluster(tree, criu_cache)


def fmt(values: list[float]) -> str:
    return f"{min(values):6.0f} {statistics.median(values):6.0f} {max(values):6.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--criu-cache", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "docker-slurm-cost.txt")
    args = ap.parse_args()
    conditions = ("cold", "warm", "edited")
    results: dict[str, list[dict[str, float]]] = {c: [] for c in conditions}
    for rep in range(args.reps):
        for c in conditions:
            results[c].append(one(c, args.criu_cache))
            print(f"rep {rep + 1} {c}: " + ", ".join(f"{k} {v:.0f}s" for k, v in results[c][-1].items()), flush=True)
    lines = [
        "docker-slurm CI test cost (tests/docker: cluster.sh build, up, demo, down), seconds, min median max",
        f"host: {platform.node()} kernel {platform.release()}, {os.cpu_count()} CPUs, engine {engine()}; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {args.reps} interleaved repetitions per condition; CRIU "
        + ("from a cache (as setup.sh leaves it in CI)" if args.criu_cache else "built in a container when cold"),
        "cold: no image of ours (debootstrap + every layer); warm: this tree's image present; "
        "edited: the image of the tree before a one-line change of src/",
        "",
        f"{'phase':8}" + "".join(f" {c + ' min/med/max':>22}" for c in conditions),
    ]
    for phase in (*PHASES, "total"):
        lines.append(f"{phase:8}" + "".join(f" {fmt([r[phase] for r in results[c]]):>22}" for c in conditions))
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
