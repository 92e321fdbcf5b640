"""The hosting wrapper's side of the coordinator process (slurmckpt.coordinator.host): start it, relay its
commits to the root agent, and start a new one when it dies, so that its death never ends the job."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, IO

RESTARTS_PER_10_MIN = 5           # a coordinator that keeps dying is a bug to report, not to loop on


def _no_interval(choice: dict[str, Any], line: str, changed: bool) -> None:
    return None


@dataclass(frozen=True)
class HostCallbacks:
    """What the hosting task does for its coordinator, built whole by task/membership.py: the wrapper's
    part (started, result, interval: its HostEvents) and the agent calls (commit, allocate, publish,
    interruptions)."""
    started: Callable[[str, str], None]               # a rank (re)started: open the replay gate
    result: Callable[[dict[str, Any], str, bool], None]         # an epoch ended (committed, aborted or skipped)
    commit: Callable[[int, dict[str, Any], str, bool], object]  # via the agent (final: hand-over); raises
    allocate: Callable[[int, bool], int]              # an epoch number >= this (final or not), via the agent
    publish: Callable[[int], object]                  # port -> address file for the ranks
    say: Callable[[str], None]
    interruptions: Callable[[], dict[str, Any]] = dict          # the partition's interruption rate, via the agent
    interval: Callable[[dict[str, Any], str, bool], None] = _no_interval   # auto chose (interval.py)


class CoordinatorSupervisor:
    def __init__(self, job: int, settings: dict[str, Any], callbacks: HostCallbacks) -> None:
        self.job, self.settings, self.cb = job, settings, callbacks
        self.proc: subprocess.Popen[bytes] | None = None
        self.link: socket.socket | None = None
        self.last_epoch = int(settings["next_epoch"]) - 1
        self.stopping = False
        self.deaths: list[float] = []
        self.exits: dict[int, int] = {}
        self._send_lock = threading.Lock()

    # ---- life cycle ------------------------------------------------------------------------------------
    def start(self) -> int:
        """Start the coordinator process; returns its port once it listens (and the address is published)."""
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slurmckpt.coordinator.host", "--link", str(theirs.fileno()),
             "--job", str(self.job)],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.link = mine
        self.file = mine.makefile("rb")
        self._send({"op": "start", **self.settings, "next_epoch": self.last_epoch + 1})
        first = self.file.readline()
        if not first:
            raise OSError("the coordinator process exited before listening")
        port = int(json.loads(first)["port"])
        self.cb.publish(port)
        threading.Thread(target=self._serve, args=(self.proc, self.file), name="coordinator-link",
                         daemon=True).start()
        return port

    def stop(self) -> None:
        """The coordinator process sees EOF on its link and exits."""
        self.stopping = True
        if self.link:
            try:
                self.link.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.link.close()

    def trigger(self, reason: str, final: bool) -> None:
        try:
            self._send({"op": "epoch", "reason": reason, "final": final})
        except OSError as e:
            self.cb.say(f"cannot ask the coordinator for a checkpoint ({reason}): {e}")

    def saw_epoch(self, epoch: int) -> None:
        self.last_epoch = max(self.last_epoch, epoch)

    # ---- link --------------------------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        assert self.link
        with self._send_lock:
            self.link.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def _serve(self, proc: subprocess.Popen[bytes], file: IO[str]) -> None:
        while line := file.readline():
            msg = json.loads(line)
            op = msg["op"]
            if op in ("commit", "allocate", "interruptions"):   # own thread: the link flows while the agent works
                target = {"commit": self._commit, "allocate": self._allocate, "interruptions": self._interruptions}
                threading.Thread(target=target[op], args=(msg,), daemon=True).start()
            elif op == "interval":
                self.cb.interval(msg["choice"], str(msg["line"]), bool(msg["changed"]))
            elif op == "started":
                self.cb.started(msg["rank"], msg["action"])
            elif op == "result":
                self.saw_epoch(int(msg["result"].get("epoch", 0)))
                self.cb.result(msg["result"], msg["reason"], bool(msg["final"]))
        if not self.stopping:
            self._died(proc)

    def _commit(self, msg: dict[str, Any]) -> None:
        error = None
        self.saw_epoch(int(msg["epoch"]))
        try:
            self.cb.commit(int(msg["epoch"]), msg["ranks"], str(msg["reason"]), msg.get("final") is True)
        except Exception as e:  # noqa: BLE001 - the epoch aborts with this message
            error = str(e) or type(e).__name__
        try:
            self._send({"op": "committed", "id": msg["id"], "error": error})
        except OSError:
            pass

    def _allocate(self, msg: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"op": "allocated", "id": msg["id"]}
        try:
            reply["epoch"] = int(self.cb.allocate(int(msg["at_least"]), msg.get("final") is True))
            self.saw_epoch(reply["epoch"])
        except Exception as e:  # noqa: BLE001 - the epoch is not started, with this message
            reply["error"] = str(e) or type(e).__name__
        try:
            self._send(reply)
        except OSError:
            pass

    def _interruptions(self, msg: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"op": "interruptions", "id": msg["id"]}
        try:
            reply["answer"] = self.cb.interruptions()
        except Exception as e:  # noqa: BLE001 - the coordinator keeps the site's value
            reply["error"] = str(e) or type(e).__name__
        try:
            self._send(reply)
        except OSError:
            pass

    def reaped(self, pid: int, code: int) -> None:
        """The wrapper (a subreaper that waits for any child) reaped `pid`: keep the status for _died."""
        self.exits[pid] = code

    def _died(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 5
        while proc.pid not in self.exits and time.monotonic() < deadline:
            time.sleep(0.05)
        code = self.exits.pop(proc.pid, None)
        how = "lost link" if code is None else f"signal {-code}" if code < 0 else f"exit {code}"
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < 600] + [now]
        if len(self.deaths) > RESTARTS_PER_10_MIN:
            self.cb.say(f"the job's coordinator died again ({how}); not restarting it: the job runs on "
                        "without new checkpoints (the last committed one stays restorable)")
            return
        self.cb.say(f"the job's coordinator died ({how}); the job runs on; starting a new one")
        for attempt in range(3):
            try:
                port = self.start()
                self.cb.say(f"new coordinator listening on port {port}; ranks reconnect, epochs go on from "
                            f"{self.last_epoch + 1}")
                return
            except OSError as e:
                self.cb.say(f"starting a new coordinator failed ({e})")
                time.sleep(1 + attempt)
