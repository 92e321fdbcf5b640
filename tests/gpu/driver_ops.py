"""Run CUDA checkpoint API calls on a pid through slurmckpt.cuda.driver and print one JSON line per call.

    python3 tests/gpu/driver_ops.py PID state lock:2000 checkpoint restore restore:pairs=OLD>NEW unlock ...

Used by the probe for calls that might hang (a frozen target): the caller runs this with a timeout.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from slurmckpt.cuda.driver import GpuDriverError, load_driver  # noqa: E402


def main() -> int:
    d = load_driver()
    pid = int(sys.argv[1])
    failed = 0
    for spec in sys.argv[2:]:
        op, _, arg = spec.partition(":")
        t = time.monotonic()
        out: dict = {"op": spec}
        try:
            if op == "state":
                out["state"] = d.state(pid).name
            elif op == "lock":
                d.lock(pid, int(arg or 2000))
            elif op == "restore":
                pairs = [tuple(p.split(">")) for p in arg.removeprefix("pairs=").split(",")] if arg else None
                d.restore(pid, pairs)
            else:
                getattr(d, op)(pid)
            out["ok"] = True
        except GpuDriverError as e:
            out.update(ok=False, code=e.code, result=e.result)
            failed += 1
        out["s"] = round(time.monotonic() - t, 4)
        print(json.dumps(out), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
