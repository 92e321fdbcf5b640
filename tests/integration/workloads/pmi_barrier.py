"""Ranks of `srun --mpi=pmi2` that speak PMI-1 to slurmstepd themselves, over the socket PMI_FD names (the
wire protocol of MPICH's simple PMI client), with state kept in memory (zdtm-style workload for
tests/integration/test_mpi.py).

Rank 0 enters a PMI barrier at once and waits there until the last rank arrives, WAIT_S seconds later: a
capture taken meanwhile would hold a request the next slurmstepd never gets. After the barrier every rank
advances a checksum for STEPS steps of 100 ms (rank 0 prints "step N"), prints "rank R final S" and sends
PMI finalize. The checksums depend on every step, so a restart from step 0 or a skipped step changes them.

Usage: pmi_barrier.py WAIT_S STEPS
"""
import hashlib
import os
import sys
import time


def ask(fd: int, request: str, answer: str) -> None:
    """One PMI-1 exchange: send `request`, read one line, require cmd=`answer` and rc=0 (if present)."""
    os.write(fd, f"cmd={request}\n".encode())
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1024)
        if not chunk:
            sys.exit(f"slurmstepd closed the PMI socket after cmd={request}")
        line += chunk
    fields = dict(f.split("=", 1) for f in line.decode().split() if "=" in f)
    if fields.get("cmd") != answer or fields.get("rc", "0") != "0":
        sys.exit(f"cmd={request}: unexpected answer {line!r}")


def main() -> None:
    wait_s, steps = float(sys.argv[1]), int(sys.argv[2])
    fd = int(os.environ["PMI_FD"])
    rank = int(os.environ.get("PMI_RANK", os.environ["SLURM_PROCID"]))
    ask(fd, "init pmi_version=1 pmi_subversion=1", "response_to_init")
    state = hashlib.sha256(f"rank {rank}".encode()).digest()
    if rank != 0:
        time.sleep(wait_s)
    print(f"rank {rank} enters the barrier", flush=True)
    ask(fd, "barrier_in", "barrier_out")
    print(f"rank {rank} passed the barrier", flush=True)
    for step in range(1, steps + 1):
        state = hashlib.sha256(state + step.to_bytes(8, "little")).digest()
        if rank == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.1)
    print(f"rank {rank} final {state.hex()[:16]}", flush=True)
    ask(fd, "finalize", "finalize_ack")


if __name__ == "__main__":
    main()
