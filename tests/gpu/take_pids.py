"""`take_pids.py PIDFILE PID...`: occupy those host pids with `sleep`s (tests/support/pids.py), print per
pid whether it was taken, append the sleeps' pids to PIDFILE (the caller kills them)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.pids import take  # noqa: E402


def main() -> int:
    pidfile, pids = Path(sys.argv[1]), [int(a) for a in sys.argv[2:]]
    taken = []
    for pid in pids:
        got = take(pid)
        print(f"  old host pid {pid}: {'TAKEN by a sleep' if got else 'not taken (busy or lost the race)'}")
        if got:
            taken.append(got.pid)
    with pidfile.open("a") as f:
        f.write("".join(f"{p}\n" for p in taken))
    return 0 if len(taken) == len(pids) else 1


if __name__ == "__main__":
    sys.exit(main())
