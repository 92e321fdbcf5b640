#!/usr/bin/env python3
"""One step's writer of a job store, for the two-node commit test (run as root, one per node namespace):

    store_writer.py ROOT CLUSTER STEP ROUNDS     allocate, persist and commit ROUNDS epochs (keep 2)
    store_writer.py ROOT CLUSTER check 0        verify every committed epoch byte for byte; print
                                                {"<step>.0": epochs kept, "allocated": highest number}
An epoch's images are a function of its number, so the checker knows what each must read back as."""
from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

from slurmckpt.store.compression import Zstd
from slurmckpt.store.persist import materialize, persist_rank
from slurmckpt.store.jobstore import JobStore
from slurmckpt.store.record import Capture

JOB = 77


def images(epoch: int) -> dict[str, bytes]:
    rnd = random.Random(epoch)
    return {"pages-1.img": rnd.randbytes(256 << 10), "pages-2.img": b"step %d\n" % epoch * 40000,
            "core-1.img": b"core%d" % epoch * 100}


def write(store: JobStore, step: str, rounds: int) -> None:
    for _ in range(rounds):
        epoch = store.allocate_epoch(1, 600, f"writer {step}")
        with tempfile.TemporaryDirectory() as staged:
            for name, data in images(epoch).items():
                (Path(staged) / name).write_bytes(data)
            persist_rank(store, epoch, step, 0, Path(staged), Capture(), Zstd(1, 2))
        store.commit(epoch, {f"{step}.0": {"kind": "image"}}, "test", keep=2)


def check(store: JobStore) -> dict:
    kept: dict[str, int] = {}
    for e in store.committed():
        (name,) = e["ranks"]
        with tempfile.TemporaryDirectory() as back:
            materialize(store, e["epoch"], name.split(".")[0], 0, Path(back))
            got = {p.name: p.read_bytes() for p in Path(back).iterdir()}
        if got != images(e["epoch"]):
            raise SystemExit(f"epoch {e['epoch']} does not read back as written")
        kept[name] = kept.get(name, 0) + 1
    return {**kept, "allocated": int((store.job_dir / "allocated-epoch").read_text())}


def main() -> None:
    root, cluster, step, rounds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    store = JobStore(root, cluster, JOB)
    store.ensure()
    if step == "check":
        print(json.dumps(check(store), sort_keys=True))
    else:
        write(store, step, rounds)


if __name__ == "__main__":
    main()
