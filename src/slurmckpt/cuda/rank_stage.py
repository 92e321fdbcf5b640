"""The rank's GPU stage as the rank's tables use it (cuda/interface.RankGpu): the CUDA stage of the tree's
CUDA processes (stage.py) or the null one of a tree without CUDA state, sizing through NVML before anything
is locked, and the restore's remap onto the GPUs visible now."""
from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager

from slurmckpt.cuda import frameworks
from slurmckpt.cuda.driver import GpuDriver, GpuInfo, load_driver
from slurmckpt.cuda.release import release
from slurmckpt.cuda.inventory import GpuInventory, NvmlUnavailable, load_inventory
from slurmckpt.cuda.procscan import find_cuda_pids, process_environ, unsupported_reasons
from slurmckpt.cuda.remap import build_pairs, check_free, visible_gpus
from slurmckpt.errors import GpuError
from slurmckpt.cuda.interface import GpuUse, holds_gpu_state
from slurmckpt.cuda.stage import GpuRollbackError, GpuUnsupportedError, NullTreeGpuStage, TreeGpuStage
from slurmckpt.node import stopped

log = logging.getLogger("slurmckpt.cuda")


class CudaRankGpu:
    """slurmckpt.cuda.interface.RankGpu (the rank tables' interface) on top of TreeGpuStage: one object per
    rank's agent.
    footprint(pids) sizes the tree's GPU state through NVML (cuda/inventory.py) before anything is locked;
    lock(pids) picks the CUDA stage or the null one; restore(record, pids) remaps onto the GPUs visible now:
    `visible_devices` is the new task's GPU list in CUDA_VISIBLE_DEVICES form (the agent takes it from Slurm's
    allocation, with `device_order` PCI_BUS_ID; the restored processes still carry the old value); None: the
    value recorded at capture. check_restore(record) refuses GPUs that cannot take the record before criu
    restores anything.

    The GPU restore runs while the tree stays stopped, only each process's restore thread running (docs/gpu.md,
    "The GPU restore runs while the tree is stopped"): criu leaves the tree stopped when `stops_for_resume()`,
    the capture hands over the processes it stopped (`left_stopped`), and resume() lets them go once every GPU
    process is back (restore() likewise lets the restored tree go)."""

    def __init__(self, lock_timeout_ms: int = 2000, *, driver_factory: Callable[[], GpuDriver] = load_driver,
                 inventory_factory: Callable[[], GpuInventory] = load_inventory,
                 nccl_env_required: bool = True, context: dict[str, Any] | None = None,
                 run_alone: Callable[[int], ContextManager[None]] = stopped.running_alone,
                 let_go: Callable[[list[int]], None] = stopped.let_go,
                 release_of: Callable[[], tuple[int, ...] | None] = release):
        self.run_alone, self.let_go, self.release_of = run_alone, let_go, release_of
        self.to_let_go: list[int] = []
        self.lock_timeout_ms, self.driver_factory = lock_timeout_ms, driver_factory
        self.inventory_factory = inventory_factory
        self.nccl_env_required, self.context = nccl_env_required, dict(context or {})
        self.stage: TreeGpuStage | NullTreeGpuStage = NullTreeGpuStage()
        self.use: GpuUse | None = None            # the last footprint (this epoch's, if it was sized)
        self.visible_devices: str | None = None
        self.device_order: str | None = None      # set with visible_devices (the agent: Slurm's index order)

    def refusals(self, pids: list[int]) -> list[str]:
        """The check stage's view (/proc, sysfs; no libcuda, no NVML): what in the tree's CUDA processes the
        driver here cannot checkpoint (MPS, MIG, managed memory, CUDA IPC, NCCL's intra-node transports),
        each naming the cause and the processes. The GPU lock looks again (TreeGpuStage.for_tree)."""
        candidates = find_cuda_pids(pids)
        return unsupported_reasons(candidates, self.nccl_env_required, self.release_of()) if candidates else []

    def footprint(self, pids: list[int]) -> GpuUse:
        """Bytes each process of the tree holds on each GPU, and notes on allocators that hold far more than
        they use. NVML's view of MIG and MPS is refused here (the /proc view again at lock). A tree without
        /dev/nvidia* never loads NVML."""
        self.use = None
        if not find_cuda_pids(pids):
            self.use = GpuUse()
            return self.use
        inventory = self.inventory_factory().snapshot()
        reasons = inventory.refusals(pids)
        if reasons:
            raise GpuUnsupportedError(reasons, **self.context)
        held = inventory.held_by(pids)
        unknown = sorted({u.pid for u in inventory.processes if u.pid in set(pids) and u.used_bytes is None})
        if unknown:
            log.warning("NVML does not tell the device memory of pid(s) %s: counted as 0", unknown,
                        extra=self.context)
        totals = {g.uuid: g.memory_total for g in inventory.gpus}
        notes = frameworks.notes([frameworks.GpuHolding(pid, uuid, n, totals.get(uuid, 0))
                                  for pid, per_gpu in held.items() for uuid, n in per_gpu.items()])
        self.use = GpuUse(held, tuple(notes))
        return self.use

    def lock(self, pids: list[int]) -> None:
        self.stage = TreeGpuStage.for_tree(pids, driver_factory=self.driver_factory,
                                       nccl_env_required=self.nccl_env_required, context=self.context,
                                       release_of=self.release_of)
        if isinstance(self.stage, TreeGpuStage):
            self.stage.run_alone, self.stage.let_go = self.run_alone, self.let_go
        self.stage.lock_all(self.lock_timeout_ms)

    def unlock(self) -> None:
        self.stage.rollback()
        self._let_go()

    def stops_for_resume(self) -> bool:
        """criu is to leave the tree stopped after a periodic dump: it holds CUDA processes."""
        return isinstance(self.stage, TreeGpuStage) and all(p.restore_tid for p in self.stage.processes)

    def left_stopped(self, pids: list[int]) -> None:
        """criu left `pids` stopped: driver calls now run each process's restore thread alone."""
        if isinstance(self.stage, TreeGpuStage):
            self.stage.stopped = True
        self.to_let_go = list(pids)

    def _let_go(self) -> None:
        if isinstance(self.stage, TreeGpuStage):
            self.stage.stopped = False
        pids, self.to_let_go = self.to_let_go, []
        self.let_go(pids)

    def checkpoint(self) -> dict[str, Any] | None:
        self.stage.checkpoint_all()
        if not self.stage.active:
            return None
        record = self.stage.record()
        if self.use is not None:     # what each GPU held at the capture: the restore needs that much free
            per_gpu: dict[str, int] = {}
            for pid in self.stage.pids:
                for uuid, n in self.use.held.get(pid, {}).items():
                    per_gpu[uuid] = per_gpu.get(uuid, 0) + n
            record["device_bytes"] = per_gpu
        return record

    def resume(self) -> None:
        """GPU restore + unlock; then the processes criu left stopped run again, unless a process is left
        behind without its GPU state (GpuRollbackError): that tree stays stopped and is killed (runner.py)."""
        try:
            self.stage.restore_all(None)
            self.stage.unlock_all()
        except GpuRollbackError:
            raise
        except GpuError:
            self.stage.rollback()
            self._let_go()
            raise
        self._let_go()

    def check_restore(self, record: dict[str, Any] | None) -> None:
        """Before criu restores anything: the GPUs this task has now take the checkpoint's GPU state (same
        chip and count, at least its memory: remap.build_pairs), none is in MIG mode or prohibits compute, and
        each has free at least the bytes the checkpoint held on its counterpart (NVML). Without NVML only the
        driver's view is checked (the GPU state is in the images already: refusing for a missing Python
        package would throw the checkpoint away)."""
        if not record or not record.get("processes"):
            return
        captured = [GpuInfo.from_dict(g) for g in record.get("gpus", [])]
        cvd = self.visible_devices if self.visible_devices is not None else record.get("cuda_visible_devices")
        now = visible_gpus(self.driver_factory().devices(), cvd, self.device_order)
        build_pairs(captured, now)
        try:
            inventory = self.inventory_factory().snapshot()
        except NvmlUnavailable as e:
            log.warning("restore checks the GPUs through the CUDA driver only: %s", e, extra=self.context)
            return
        check_free(captured, now, inventory, record.get("device_bytes", {}), self.context)

    def restore(self, record: dict[str, Any] | None, pids: list[int]) -> None:
        """After criu restored the tree `pids`, left stopped (holds_gpu_state): GPU state back, unlocked, and
        the tree let go. On failure it stays stopped (the restore's undo kills it)."""
        if not holds_gpu_state(record):
            return
        assert record is not None
        driver = self.driver_factory()
        stage = TreeGpuStage.adopt_restored(driver, record, pids, self.context, run_alone=self.run_alone)
        env = process_environ(stage.pids[0]) if stage.pids else {}
        cvd = self.visible_devices if self.visible_devices is not None else stage.cuda_visible_devices
        now = visible_gpus(driver.devices(), cvd, self.device_order or env.get("CUDA_DEVICE_ORDER"))
        pairs = build_pairs(stage.gpus, now)
        self.stage = stage
        stage.restore_all(pairs)
        stage.unlock_all()
        stage.stopped = False
        self.let_go(sorted(pids))
