"""Whether this rank's final capture fits in what is left of the window Slurm gives (docs/operations.md, "The
time Slurm gives a final capture"), judged by the rank's agent in the final epoch's SIZE phase, before
anything is locked or frozen.

The window is read once, when the agent starts (slurm/window.py: KillWait; the GraceTime of the job's
partition or QOS, whichever PreemptType reads). At the capture, slurmctld says whether the job is being
preempted (only asked where a GraceTime applies). The capture's cost is the rank's own: its newest committed
capture (rank.json's stage timings and raw bytes) scaled to the bytes SIZE measured now, else the budget's
rates (coordinator/budget.py). What counts is the path until the images are complete in the node's staging;
the persist comes after Slurm's SIGKILL (store/handover.py). `elapsed_s` is how long ago the trigger reached
the job's coordinator (the user's process: a lie there only costs the user's own capture).

A capture that does not fit is refused with WindowTooShort: the epoch aborts before any rank freezes, the
previous commit stays, and the refusal (recorded as the final capture's failure: fresh_start.py) reaches the
job's output, its AdminComment and slurmd's log.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from slurmckpt.coordinator.budget import MeasuredCapture, RankSize, WindowVerdict, final_capture_cost, judge_final
from slurmckpt import validate
from slurmckpt.errors import SlurmckptError, WindowTooShort
from slurmckpt.rank.context import Limits
from slurmckpt.rank.fit import Footprint
from slurmckpt.slurm.window import KillWindow
from slurmckpt.store import space
from slurmckpt.store.jobstore import JobStore, list_jobs
from slurmckpt.store.record import RankRecord

log = logging.getLogger("slurmckpt.window")


def measured(store: JobStore, step: str, rank: int) -> MeasuredCapture | None:
    """The rank's newest committed capture, as its rank.json recorded it."""
    manifest = space.previous_manifest(store, step, rank)
    return None if manifest is None else _from_manifest(manifest)


def _from_manifest(manifest: RankRecord) -> MeasuredCapture | None:
    """None for a record without stage timings (written before they were kept)."""
    timings = manifest.capture.timings
    if not timings:
        return None
    return MeasuredCapture.from_timings(manifest.seal.epoch, manifest.seal.raw_bytes(), dict(timings))


def measured_here(store_root: Path, cluster: str, jobs: int = 50) -> tuple[MeasuredCapture | None, int]:
    """The rate of the captures this cluster's store holds (`slurmckpt doctor`): the newest commit of up to
    `jobs` jobs, every image rank of it, summed into one capture (bytes, byte-stage seconds; fixed seconds:
    the median). (None, 0) when none was measured."""
    found = []
    ours = sorted((job for c, job in list_jobs(store_root) if c == cluster), reverse=True)
    for job in ours[:jobs]:
        store = JobStore(store_root, cluster, job)
        try:
            newest = next(iter(store.committed()), None)
        except SlurmckptError:
            continue
        if newest is None:
            continue
        for name, record in newest["ranks"].items():
            if record.get("kind") != "image":
                continue
            try:
                step, rank = validate.rank_name(name)
                manifest = store.read_rank_manifest(newest["epoch"], step, rank)
            except SlurmckptError:
                continue
            one = _from_manifest(manifest)
            if one is not None:
                found.append(one)
    if not found:
        return None, 0
    fixed = sorted(m.fixed_s for m in found)[len(found) // 2]
    return MeasuredCapture(0, sum(m.nbytes for m in found), sum(m.byte_s for m in found), fixed), len(found)


def restores_instead(store: JobStore, now: float) -> str:
    """What a requeue restores when no final capture is taken: the newest commit and its age."""
    try:
        newest = next(iter(store.committed()), None)
    except SlurmckptError:
        newest = None
    if newest is None:
        return "no checkpoint was committed yet: the job starts from the beginning"
    taken = newest.get("captured_at", newest.get("committed_at"))
    age = f", taken {max(0.0, now - float(taken)):.0f} s before this requeue" if isinstance(taken, (int, float)) else ""
    return f"the job restores epoch {newest['epoch']}{age}"


@dataclass
class FinalWindow:
    window: KillWindow
    job: int
    preempted: Callable[[int], bool]          # slurmctld's word (control.CliSlurm.preempted); raises SlurmError
    clock: Callable[[], float] = time.time

    def allowed(self) -> tuple[int, str]:
        """(seconds, their description) Slurm gives this run from its SIGTERM to its SIGKILL."""
        preempted = False
        if self.window.grace_s:
            try:
                preempted = self.preempted(self.job)
            except SlurmckptError as e:        # the shorter window: a capture skipped rather than killed
                log.warning("could not learn whether job %d is being preempted (%s): KillWait alone counts",
                            self.job, e)
        return self.window.seconds(preempted), self.window.describe(preempted)

    def judge(self, store: JobStore, step: str, rank: int, fp: Footprint, elapsed_s: float) -> WindowVerdict:
        size = RankSize(f"{step}.{rank}", "", fp.host_bytes, fp.gpu_bytes, len(fp.gpu.held))
        cost = final_capture_cost(size, measured(store, step, rank))
        seconds, described = self.allowed()
        verdict = judge_final(cost, seconds, described, elapsed_s)
        log.info("final capture %s: %s", "fits" if verdict.fits else "does not fit", verdict.text)
        return verdict

    def require(self, store: JobStore, step: str, rank: int, fp: Footprint, elapsed_s: float, epoch: int) -> None:
        """WindowTooShort when this rank's final capture would not end before Slurm's SIGKILL."""
        verdict = self.judge(store, step, rank, fp, elapsed_s)
        if not verdict.fits:
            raise WindowTooShort(f"final capture skipped: {verdict.text}; {restores_instead(store, self.clock())}")


class Runner(Protocol):
    def stage_failed(self, stage: str) -> None: ...

    @property
    def footprint(self) -> Footprint | None: ...

    def size(self, epoch: int) -> dict[str, Any]: ...


def sized(runner: Runner, epoch: int, message: dict[str, Any], window: FinalWindow | None, store: JobStore,
          step: str, rank: int, limits: Limits) -> dict[str, Any]:
    """SIZE of `epoch` (the runner's reply), then, for a final epoch after Slurm's SIGTERM, check_final with
    the time this agent spent on it."""
    asked = time.monotonic()
    reply = runner.size(epoch)
    check_final(window, store, step, rank, runner, message, time.monotonic() - asked, limits)
    return reply


def check_final(window: FinalWindow | None, store: JobStore, step: str, rank: int, runner: Runner,
                message: dict[str, Any], here_s: float = 0.0, limits: Limits | None = None) -> None:
    """A final epoch's SIZE after Slurm's SIGTERM: WindowTooShort (stage `window`) when this rank's capture
    would not end before the SIGKILL; `here_s`: what this agent spent on the message so far (`limits`: the
    tests' pause after SIZE, stall_after_size, comes first). Other triggers (wall-time, a manual requeue)
    end before Slurm's signal: no window."""
    if limits is not None:
        paused = time.monotonic()
        stall_after_size(limits)
        here_s += time.monotonic() - paused
    if window is None or message.get("final") is not True or message.get("trigger") != "sigterm" \
            or runner.footprint is None:
        return
    try:
        window.require(store, step, rank, runner.footprint, trigger_age(message) + max(0.0, here_s),
                       int(message.get("epoch", 0)))
    except WindowTooShort:
        runner.stage_failed("window")
        raise


def stall_after_size(limits: Limits) -> None:
    """Config.debug_stall_after `size:SECONDS` (tests only): the SIZE of every epoch pauses before its window
    is judged, as a SIGTERM that came late in its window would (tests/integration/test_kill_window.py)."""
    if limits.stall_after and limits.stall_after[0] == "size":
        log.warning("debug_stall_after: pausing %.1fs after size", limits.stall_after[1])
        time.sleep(limits.stall_after[1])


def trigger_age(message: dict[str, Any]) -> float:
    """The coordinator's `trigger_age_s` (seconds since the final trigger reached it), bounded."""
    value = message.get("trigger_age_s", 0.0)
    return min(float(value), 86400.0) if isinstance(value, (int, float)) and value >= 0 else 0.0
