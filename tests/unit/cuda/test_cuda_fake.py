"""The fake CUDA driver: the state machine, lock timeouts and collectives the lock-round tests rely on."""
from __future__ import annotations

import pytest

from slurmckpt.cuda.driver import GpuDriver, GpuDriverError, ProcessState
from slurmckpt.cuda.fake import FakeGpuDriver, fake_gpus


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def d(clock: Clock) -> FakeGpuDriver:
    drv = FakeGpuDriver(fake_gpus(2), sleep=clock.sleep, clock=clock)
    drv.add_process(1)
    drv.add_process(2)
    return drv


def code(exc: pytest.ExceptionInfo) -> int:
    return exc.value.code


def test_is_a_gpu_driver(d):
    assert isinstance(d, GpuDriver)


def test_full_cycle(d):
    d.lock(1, 100)
    assert d.state(1) is ProcessState.LOCKED
    d.checkpoint(1)
    assert d.state(1) is ProcessState.CHECKPOINTED
    d.restore(1)
    assert d.state(1) is ProcessState.LOCKED
    d.unlock(1)
    assert d.state(1) is ProcessState.RUNNING
    assert d.calls == [("lock", 1), ("checkpoint", 1), ("restore", 1), ("unlock", 1)]


@pytest.mark.parametrize("op", ["checkpoint", "restore", "unlock"])
def test_illegal_transitions_fail_and_keep_the_state(d, op):
    with pytest.raises(GpuDriverError) as e:
        getattr(d, op)(1)
    assert code(e) == 401 and d.state(1) is ProcessState.RUNNING
    d.lock(1, 100)
    d.checkpoint(1)
    with pytest.raises(GpuDriverError):
        d.lock(1, 100)
    with pytest.raises(GpuDriverError):
        d.unlock(1)
    assert d.state(1) is ProcessState.CHECKPOINTED


def test_unknown_pid_and_process_without_cuda(d):
    with pytest.raises(GpuDriverError) as e:
        d.state(99)
    assert code(e) == 304
    d.add_process(3, cuda=False)
    assert d.state(3) is ProcessState.NO_CUDA
    with pytest.raises(GpuDriverError) as e:
        d.lock(3, 10)
    assert code(e) == 3


def test_lock_times_out_after_exactly_the_timeout_and_leaves_it_running(d, clock):
    d.busy(1, 5.0)
    with pytest.raises(GpuDriverError) as e:
        d.lock(1, 200)
    assert code(e) == 600 and e.value.timed_out
    assert clock.slept == [0.2] and d.state(1) is ProcessState.RUNNING


def test_lock_succeeds_when_the_kernel_ends_within_the_timeout(d, clock):
    d.busy(1, 0.5)
    d.lock(1, 1000)
    assert d.state(1) is ProcessState.LOCKED


def test_half_entered_collective_blocks_lock_until_every_member_entered(d):
    c = d.collective([1, 2])
    assert d.enter(c, 1)
    with pytest.raises(GpuDriverError) as e:
        d.lock(1, 50)
    assert code(e) == 600
    d.lock(2, 50)                             # rank 2 has not entered: nothing in flight, it locks
    assert not d.enter(c, 2)                  # a locked process makes no progress
    d.step()
    assert not c.complete
    with pytest.raises(GpuDriverError):       # so rank 1 stays stuck
        d.lock(1, 50)
    d.unlock(2)
    d.step()                                  # unlocked, rank 2 reaches the collective
    assert c.complete
    d.lock(1, 50)
    assert d.states() == {1: ProcessState.LOCKED, 2: ProcessState.RUNNING}


def test_restore_checks_pairs(d):
    gpus = d.devices()
    d.add_process(5, gpus=[gpus[0].uuid])
    d.lock(5, 10)
    d.checkpoint(5)
    with pytest.raises(GpuDriverError) as e:          # pairs that leave out the checkpointed GPU
        d.restore(5, [(gpus[1].uuid, gpus[0].uuid)])
    assert code(e) == 1 and d.state(5) is ProcessState.CHECKPOINTED
    d.restore(5, [(gpus[0].uuid, gpus[1].uuid)])
    assert d.restore_pairs[5] == [(gpus[0].uuid, gpus[1].uuid)]
    d.unlock(5)
    d.lock(5, 10)
    d.checkpoint(5)
    d.set_gpus(fake_gpus(1, tag=9))                   # another node: old GPU gone, no pairs -> refused
    with pytest.raises(GpuDriverError):
        d.restore(5)


def test_injected_fault_fails_once(d):
    d.fail_next("lock", 1, 801)
    with pytest.raises(GpuDriverError) as e:
        d.lock(1, 10)
    assert code(e) == 801 and d.state(1) is ProcessState.RUNNING
    d.lock(1, 10)
