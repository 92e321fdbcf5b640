"""GPU remapping on restore: the GPUs a rank used at capture -> the GPUs it has now, by position.

The job sees its GPUs in CUDA_VISIBLE_DEVICES order (Slurm sets it per step); the process's own CUDA ordinal k
is the k-th entry there. A requeued job may get other GPUs (other UUIDs, other order): the k-th GPU recorded at
capture is paired with the k-th GPU visible now, and the driver is given the full old->new list (it wants
every checkpointed GPU listed). Restore onto GPUs of another chip, another count or less memory is refused,
and (NVML's view, `check_free`) onto a GPU in MIG mode, one that prohibits compute, or one with less memory
free than the checkpoint held on its counterpart.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from slurmckpt.cuda.driver import GpuInfo, GpuPair
from slurmckpt.cuda.inventory import Inventory
from slurmckpt.errors import GpuError
from slurmckpt.sizes import size_text


class GpuRemapError(GpuError):
    """The GPUs visible at restore cannot take the checkpointed GPU state."""


def visible_gpus(devices: Sequence[GpuInfo], cuda_visible_devices: str | None,
                 device_order: str | None = None) -> list[GpuInfo]:
    """The job's GPUs in its own CUDA ordinal order.

    `devices`: what the agent's driver enumerates (the agent runs without CUDA_VISIBLE_DEVICES, so: all GPUs
    of the node, in CUDA's default FASTEST_FIRST order). `cuda_visible_devices`: the job's value (indices, full
    or abbreviated GPU-UUIDs); None means all. `device_order`: the job's CUDA_DEVICE_ORDER; PCI_BUS_ID
    re-sorts the node's GPUs by bus id before indices are applied. MIG instances are refused.
    """
    base = sorted(devices, key=lambda g: g.pci_bus_id.lower()) if device_order == "PCI_BUS_ID" else list(devices)
    if cuda_visible_devices is None:
        return base
    out: list[GpuInfo] = []
    for item in (s.strip() for s in cuda_visible_devices.split(",")):
        if not item:
            break
        if item.upper().startswith("MIG-"):
            raise GpuRemapError(f"CUDA_VISIBLE_DEVICES names a MIG instance ({item}): MIG is not supported "
                                f"by the CUDA checkpoint API")
        if item.lstrip("-").isdigit():
            idx = int(item)
            if idx < 0 or idx >= len(base):
                break                    # CUDA stops at the first invalid entry
            gpu = base[idx]
        else:
            hits = [g for g in base if g.uuid.lower().startswith(item.lower() if item.upper().startswith("GPU-")
                                                                 else "gpu-" + item.lower())]
            if len(hits) != 1:
                break
            gpu = hits[0]
        if gpu in out:
            break                        # a repeated device also ends the list
        out.append(gpu)
    return out


def build_pairs(captured: Sequence[GpuInfo], visible: Sequence[GpuInfo]) -> list[GpuPair]:
    """Full old->new pair list, position by position, or GpuRemapError naming what does not fit."""
    for label, gpus in (("captured", captured), ("visible", visible)):
        uuids = [g.uuid for g in gpus]
        if len(set(uuids)) != len(uuids):
            raise GpuRemapError(f"{label} GPU list names a GPU twice: {uuids}")
    if len(captured) != len(visible):
        raise GpuRemapError(
            f"GPU count differs: the checkpoint used {len(captured)} GPU(s) "
            f"({', '.join(g.name for g in captured) or 'none'}), this allocation has {len(visible)}; "
            f"request the same number of GPUs (--gres=gpu:{len(captured)})",
            captured=len(captured), visible=len(visible))
    pairs: list[GpuPair] = []
    problems: list[str] = []
    for pos, (old, new) in enumerate(zip(captured, visible)):
        if old.name != new.name:
            problems.append(f"GPU {pos}: chip {new.name!r} ({new.uuid}) differs from checkpointed {old.name!r}")
        elif new.total_memory < old.total_memory:
            problems.append(f"GPU {pos}: {new.uuid} has {new.total_memory} bytes of memory, "
                            f"less than the {old.total_memory} of the checkpointed {old.uuid}")
        pairs.append((old.uuid, new.uuid))
    if problems:
        raise GpuRemapError("GPUs not compatible with the checkpoint: " + "; ".join(problems))
    return pairs


def is_identity(pairs: Sequence[GpuPair]) -> bool:
    return all(old == new for old, new in pairs)


def check_free(captured: Sequence[GpuInfo], now: Sequence[GpuInfo], inventory: Inventory,
               device_bytes: Mapping[str, int], context: Mapping[str, Any] | None = None) -> None:
    """GpuRemapError naming every GPU of `now` (paired by position with `captured`) that NVML shows cannot
    take what the checkpoint held on its counterpart (`device_bytes`: captured uuid -> bytes)."""
    problems = []
    for pos, (old, new) in enumerate(zip(captured, now)):
        gpu = inventory.gpu(new.uuid)
        if gpu is None:
            problems.append(f"GPU {pos} ({new.uuid}) is not known to NVML")
            continue
        if gpu.mig_enabled:
            problems.append(f"GPU {pos} ({new.uuid}) is in MIG mode")
        if gpu.compute_mode == "PROHIBITED":
            problems.append(f"GPU {pos} ({new.uuid}) prohibits compute (compute mode PROHIBITED)")
        held = int(device_bytes.get(old.uuid, 0))
        if held > gpu.memory_free:
            problems.append(f"GPU {pos} ({new.uuid}) has {size_text(gpu.memory_free)} free ({size_text(gpu.memory_used)} in "
                            f"use by other processes), the checkpoint holds {size_text(held)} on it: "
                            f"{size_text(held - gpu.memory_free)} short")
    if problems:
        raise GpuRemapError("GPUs of this allocation cannot take the checkpoint's GPU state: " + "; ".join(problems),
                            **dict(context or {}))
