"""The kernel's writeback limit against a GPU node's memory (node/writeback.py): the limit as the kernel
computes it, where staging sits, and doctor's line."""
from __future__ import annotations

from pathlib import Path

from slurmckpt.node import writeback

GiB = 1 << 30
MOUNTS = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
          "30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw",
          "31 22 8:2 / /var/lib/slurmckpt rw shared:5 - xfs /dev/sdb1 rw",
          "32 31 0:40 / /var/lib/slurmckpt/mem\\040stage rw shared:6 - tmpfs tmpfs rw,size=64g"]
NODE = {"MemTotal": 125 * GiB, "MemFree": 80 * GiB, "Active(file)": 6 * GiB, "Inactive(file)": 4 * GiB,
        "MemAvailable": 110 * GiB}


def vm(ratio: int = 20, fixed: int = 0):
    return lambda name: {"dirty_ratio": ratio, "dirty_bytes": fixed}[name]


def test_the_limit_is_the_ratio_of_free_and_file_pages_or_dirty_bytes_when_set() -> None:
    limit = writeback.dirty_limit(NODE, vm())
    assert (limit.bytes, limit.ratio, limit.dirtyable) == (18 * GiB, 20, 90 * GiB)
    assert limit.describe() == "vm.dirty_ratio 20 % of ~90.0 GiB"
    fixed = writeback.dirty_limit(NODE, vm(fixed=40 * GiB))
    assert (fixed.bytes, fixed.ratio) == (40 * GiB, 0) and fixed.describe() == "vm.dirty_bytes 40.0 GiB"


def test_the_staging_file_system_is_the_deepest_mount_above_it() -> None:
    assert writeback.fs_type(Path("/var/lib/slurmckpt/staging"), MOUNTS) == "xfs"
    assert writeback.fs_type(Path("/var/lib/slurmckpt/mem stage/x"), MOUNTS) == "tmpfs"
    assert writeback.fs_type(Path("/var/lib/slurmckpt-other"), MOUNTS) == "ext4"
    assert writeback.fs_type(Path("/dev/shm"), MOUNTS) == "tmpfs"


def test_doctor_warns_where_the_gpus_outgrow_the_limit_and_names_the_ratio_that_holds_them() -> None:
    staging = Path("/var/lib/slurmckpt/staging")
    ok, what, detail = writeback.check(16 * GiB, staging, NODE, vm(), MOUNTS)
    assert ok is True and "fit under the dirty limit (18.0 GiB: vm.dirty_ratio 20 % of ~90.0 GiB)" in detail
    ok, _, detail = writeback.check(80 * GiB, staging, NODE, vm(), MOUNTS)
    assert ok is None and "more than 18.0 GiB" in detail and "the GPUs hold 80.0 GiB" in detail
    assert "raise vm.dirty_ratio to 94" not in detail and "put staging_dir on a tmpfs sized for it" in detail
    ok, _, detail = writeback.check(40 * GiB, staging, NODE, vm(), MOUNTS)
    assert ok is None and "raise vm.dirty_ratio to 50 (or vm.dirty_bytes past 40.0 GiB)" in detail
    assert writeback.check(40 * GiB, staging, NODE, vm(fixed=48 * GiB), MOUNTS)[0] is True
    ok, _, detail = writeback.check(80 * GiB, Path("/var/lib/slurmckpt/mem stage"), NODE, vm(), MOUNTS)
    assert ok is True and "is on tmpfs" in detail
