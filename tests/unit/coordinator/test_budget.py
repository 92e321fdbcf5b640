"""An epoch's budget from the ranks' sizes: the `sized` reply is validated like every reply, GPU copies of
ranks sharing a node or a memory cgroup are summed against its room, and phase timeouts follow the bytes at
the measured rates with the configured values as floors."""
from __future__ import annotations

import pytest

from slurmckpt.coordinator.budget import PhaseTimeouts, RankSize, refusals
from slurmckpt.errors import ProtocolError

GIB = 1 << 30
GB = 10**9


def size(rank: str, node: str = "n1", gpu: int = 0, host: int = GIB, procs: int = 1, avail: int = 2048 * GIB,
         cgroup: str = "", room: int = 2**62) -> RankSize:
    return RankSize(rank, node, host, gpu, procs if gpu else 0, gpu, avail, cgroup, room)


@pytest.mark.parametrize("reply, field", [
    ({"gpu_bytes": -1}, "gpu_bytes"), ({"host_bytes": 1.5}, "host_bytes"), ({"mem_available": True}, "mem_available"),
    ({"gpu_bytes": 2**63}, "gpu_bytes"), ({"gpu_processes": 10**9}, "gpu_processes"),
    ({"cgroup": "x" * 600}, "cgroup"), ({"gpu_bytes": 5, "largest_process_bytes": 6}, "largest_process_bytes")])
def test_a_bad_sized_reply_is_refused_naming_the_field(reply, field):
    with pytest.raises(ProtocolError, match=field):
        RankSize.from_reply("0.0", "n1", reply)


def test_a_sized_reply_reads_back_and_missing_fields_mean_no_limit():
    s = RankSize.from_reply("0.1", "n2", {"host_bytes": 5, "gpu_bytes": 9, "gpu_processes": 2,
                                          "largest_process_bytes": 6, "mem_available": 100})
    assert (s.image_bytes, s.gpu_processes, s.mem_available, s.cgroup, s.cgroup_headroom) == (14, 2, 100, "", 2**62)


def test_ranks_that_fit_alone_but_not_together_on_a_node_are_refused():
    sizes = [size("0.0", gpu=100 * GIB, avail=150 * GIB), size("0.1", gpu=100 * GIB, avail=160 * GIB),
             size("0.2", node="n2", gpu=100 * GIB, avail=150 * GIB)]
    (first, why), = refusals(sizes)
    assert first.rank == "0.0"
    assert why == ("on node n1 the GPU checkpoints of ranks 0.0, 0.1 copy 200.0 GiB of device memory into host "
                   "memory, the node has 150.0 GiB available (MemAvailable): 50.0 GiB short")


def test_ranks_under_one_memory_cgroup_are_summed_against_its_room():
    sizes = [size("0.0", gpu=40 * GIB, cgroup="/job_7", room=70 * GIB),
             size("0.1", gpu=40 * GIB, cgroup="/job_7", room=70 * GIB),
             size("0.2", gpu=40 * GIB, cgroup="/job_8", room=70 * GIB)]
    (_, why), = refusals(sizes)
    assert "ranks 0.0, 0.1 copy 80.0 GiB into memory cgroup /job_7, which has room for 70.0 GiB: 10.0 GiB short" in why
    assert refusals(sizes[:1] + sizes[2:]) == []


def test_small_epochs_keep_the_configured_timeouts():
    t = PhaseTimeouts.derive([size("0.0"), size("0.1")], 30.0, 600.0)
    assert (t.prepare, t.capture, t.resume) == (30.0, 600.0, 600.0)
    assert t.abort_after("prepare") == pytest.approx(30.0)        # nothing of size to wait for


def test_a_108_gb_gpu_rank_gets_timeouts_from_its_bytes():
    """JAX's default on an H200: ~108 GB. GPU checkpoint at 2 GB/s + 0.5 s, twice over, plus the freeze;
    CRIU writes it with the host memory at 1 GB/s and the seal reads it back at 1.6 GB/s."""
    t = PhaseTimeouts.derive([size("0.0", gpu=108 * GB, host=0)], 30.0, 60.0)
    assert t.prepare == pytest.approx(2 * (0.5 + 54) + 10, abs=0.1)
    assert t.capture == pytest.approx(2 * (108 + 108 / 1.6), abs=0.1)
    assert t.resume == pytest.approx(2 * (0.5 + 108 / 5.5 + 108 / 1.6), abs=0.1)
    assert t.abort_after("prepare") == pytest.approx(30 + t.prepare + 2 * (0.5 + 108 / 5.5), abs=0.2)


def test_ranks_sharing_a_node_share_its_rates():
    """Eight 100 GB ranks on one node: the node's 6 GB/s for GPU copies and 1.6 GB/s disk bound them, not one
    rank's own rate; the same ranks on eight nodes take one rank's time."""
    one_node = PhaseTimeouts.derive([size(f"0.{i}", gpu=100 * GB, host=0) for i in range(8)], 30.0, 60.0)
    spread = PhaseTimeouts.derive([size(f"0.{i}", node=f"n{i}", gpu=100 * GB, host=0) for i in range(8)], 30.0, 60.0)
    assert one_node.prepare == pytest.approx(2 * (0.5 + 800 / 6) + 10, abs=0.1)
    assert spread.prepare == pytest.approx(2 * (0.5 + 50) + 10, abs=0.1)
    assert one_node.capture == pytest.approx(2 * (800 / 1.6 + 800 / 1.6), abs=0.1)
    assert spread.capture < one_node.capture / 4
