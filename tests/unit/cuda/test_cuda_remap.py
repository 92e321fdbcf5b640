"""GPU remapping on restore: visible GPUs in the job's order, full old->new pairs, refusals that say why."""
from __future__ import annotations

import pytest

from slurmckpt.cuda.driver import GpuInfo
from slurmckpt.cuda.fake import fake_gpus
from slurmckpt.cuda.remap import GpuRemapError, build_pairs, is_identity, visible_gpus

NODE_A = fake_gpus(4, tag=0xA)
NODE_B = fake_gpus(4, tag=0xB)


def test_same_gpus_give_identity_pairs():
    pairs = build_pairs(NODE_A[:2], NODE_A[:2])
    assert pairs == [(NODE_A[0].uuid, NODE_A[0].uuid), (NODE_A[1].uuid, NODE_A[1].uuid)] and is_identity(pairs)


def test_other_gpus_are_paired_by_position():
    pairs = build_pairs([NODE_A[2], NODE_A[3]], [NODE_B[1], NODE_B[0]])
    assert pairs == [(NODE_A[2].uuid, NODE_B[1].uuid), (NODE_A[3].uuid, NODE_B[0].uuid)]
    assert not is_identity(pairs)


def test_count_mismatch_is_refused_with_the_fix():
    with pytest.raises(GpuRemapError, match=r"checkpoint used 2 GPU\(s\).*has 1.*--gres=gpu:2"):
        build_pairs(NODE_A[:2], NODE_B[:1])
    with pytest.raises(GpuRemapError, match="has 3"):
        build_pairs(NODE_A[:2], NODE_B[:3])


def test_other_chip_is_refused():
    h100 = fake_gpus(1, name="NVIDIA H100 80GB HBM3", memory=85_000_000_000, tag=0xC)
    with pytest.raises(GpuRemapError, match=r"GPU 0: chip 'NVIDIA H100 80GB HBM3'.*'NVIDIA H200'"):
        build_pairs(NODE_A[:1], h100)


def test_less_memory_is_refused_more_is_fine():
    small = [GpuInfo(0, NODE_B[0].uuid, "NVIDIA H200", NODE_A[0].total_memory - 1)]
    with pytest.raises(GpuRemapError, match="less than"):
        build_pairs(NODE_A[:1], small)
    big = [GpuInfo(0, NODE_B[0].uuid, "NVIDIA H200", NODE_A[0].total_memory + 1)]
    assert build_pairs(NODE_A[:1], big) == [(NODE_A[0].uuid, NODE_B[0].uuid)]


def test_duplicate_gpu_is_refused():
    with pytest.raises(GpuRemapError, match="twice"):
        build_pairs([NODE_A[0], NODE_A[0]], NODE_B[:2])


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus(NODE_A, None) == NODE_A
    assert visible_gpus(NODE_A, "2,0") == [NODE_A[2], NODE_A[0]]
    distinct = [GpuInfo(i, f"GPU-{i}{i}{i}e00d4-f0ea-94e8-ca66-db6b41289559", "NVIDIA H200", 1) for i in range(3)]
    assert visible_gpus(distinct, "GPU-222e," + distinct[1].uuid) == [distinct[2], distinct[1]]
    assert visible_gpus(distinct, "111e00d4") == [distinct[1]]              # without the GPU- prefix
    assert visible_gpus(NODE_A, NODE_A[3].uuid + "," + NODE_A[1].uuid[:12]) == [NODE_A[3]]   # ambiguous: stop
    assert visible_gpus(NODE_A, "1,7,0") == [NODE_A[1]]                     # CUDA stops at an invalid entry
    assert visible_gpus(NODE_A, "1,1,0") == [NODE_A[1]]                     # and at a repeated one
    assert visible_gpus(NODE_A, "") == []


def test_pci_bus_id_order():
    shuffled = [NODE_A[2], NODE_A[0], NODE_A[3], NODE_A[1]]
    assert visible_gpus(shuffled, "0,1", "PCI_BUS_ID") == [NODE_A[0], NODE_A[1]]
    assert visible_gpus(shuffled, "0,1") == [NODE_A[2], NODE_A[0]]


def test_mig_is_refused():
    with pytest.raises(GpuRemapError, match="MIG"):
        visible_gpus(NODE_A, "MIG-4f6f3f1c-aaaa-bbbb-cccc-dddddddddddd")


def test_end_to_end_requeue_on_another_node():
    captured = visible_gpus(NODE_A, "1,3")
    now = visible_gpus(NODE_B, "0,2")
    assert build_pairs(captured, now) == [(NODE_A[1].uuid, NODE_B[0].uuid), (NODE_A[3].uuid, NODE_B[2].uuid)]
