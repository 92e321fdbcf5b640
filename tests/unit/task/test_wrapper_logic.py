"""The wrapper's decisions, with a fake agent channel, a fake membership and a fake Slurm: restore the newest
committed epoch, fall back to an older one, then to a fresh start; withdraw the epoch for the whole job when
other ranks share the cut; SIGTERM asks for a final capture (never forwarded), the capture signals ask for
captures, other signals are forwarded to the tree; a lost agent is said once and the tree ends with the task.
The same wrapper against the real agent, Slurm and CRIU: tests/integration."""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from slurmckpt.task import start as task_start, wrapper
from slurmckpt.task.epochs import with_interval
from slurmckpt.config import Config
from slurmckpt.errors import LockContended, RestoreError, SlurmckptError
from slurmckpt.slurm import control
from slurmckpt.slurm.env import TaskEnv


class FakeChannel:
    """The agent's side of Channel.call: `answers` maps an op to a reply, an exception to raise, or a function
    of the call's arguments returning either; an op without an answer replies {}."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers
        self.calls: list[tuple[str, dict]] = []

    def call(self, op: str, fds: list[int] | None = None, **args: object) -> dict:
        self.calls.append((op, {**args, "nfds": len(fds or [])}))
        answer = self.answers.get(op, {})
        if callable(answer) and not isinstance(answer, type):
            answer = answer(args)
        if isinstance(answer, BaseException):
            raise answer
        return dict(answer)

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]

    def close(self) -> None:
        pass


class FakeMember:
    """Membership as the wrapper uses it: records events and capture triggers."""

    def __init__(self, connected: bool) -> None:
        self.connected = connected
        self.supervisor = None        # not the coordinator's host
        self.events: list[tuple[str, dict]] = []
        self.triggers: list[tuple[str, bool]] = []
        self.closed: list[int] = []

    def event(self, kind: str, wait_ack: bool = False, **fields: object) -> None:
        self.events.append((kind, fields))

    def trigger(self, reason: str, final: bool) -> None:
        self.triggers.append((reason, final))

    def reaped(self, pid: int, code: int) -> None:
        pass

    def close(self, status: int, completed: bool = True) -> None:
        self.closed.append((status, completed))

    def stop(self) -> None:
        pass


class FakeControl:
    """slurm.control's job control, as the wrapper asks it: requeue, and the job's state."""

    def __init__(self) -> None:
        self.requeued: list[int] = []

    def requeue(self, job_id: int) -> None:
        self.requeued.append(job_id)

    def job(self, job_id: int) -> dict:
        return {"job_state": "REQUEUED" if self.requeued else "RUNNING"}


@pytest.fixture
def said(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(wrapper, "say", lambda env, text: lines.append(text))
    return lines


@pytest.fixture
def slurm(monkeypatch) -> FakeControl:
    fake = FakeControl()
    monkeypatch.setattr(control, "default_control", lambda: fake)
    monkeypatch.setattr(control, "CliSlurm", lambda timeout_s=30.0: fake)
    return fake


@pytest.fixture
def make(monkeypatch, said, slurm):
    monkeypatch.setattr(wrapper, "load_user_config", Config)
    socks: list[socket.socket] = []

    def build(answers: dict | None = None, step: str = "0", tasks: int = 1, connected: bool = False):
        mine, theirs = socket.socketpair()
        socks.append(theirs)
        env = TaskEnv(job_id=7, step=step, rank=0, restart_count=1, interval_s=0, agent_fd=mine.detach(),
                      argv0=None, node="n1", tasks=tasks)
        w = wrapper.Wrapper(env, ["app"])
        w.agent.close()                          # the channel the wrapper opened on that fd: not used here
        w.agent, w.member = FakeChannel(answers or {}), FakeMember(connected)
        w.task.member = w.member                 # the task's start reports to the same (fake) membership
        return w
    yield build
    for s in socks:
        s.close()


@pytest.fixture
def tree():
    """A real process standing for the task's tree (signals reach it for real). Default dispositions: a
    test runner started with SIGINT/SIGHUP ignored (nohup, a background job) must not pass that on."""
    def default_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
    p = subprocess.Popen(["sleep", "60"], preexec_fn=default_signals)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def image(epoch: int) -> dict:
    return {"epoch": epoch, "kind": "image"}


def restores(failing: set[int], pid: int = 4242):
    return lambda args: (RestoreError(f"criu restore of epoch {args['epoch']} failed")
                         if args["epoch"] in failing else {"pid": pid, "kind": "image", "seconds": 0.1})


# ---- restore, fall back, start fresh -------------------------------------------------------------------------
def test_nothing_committed_starts_the_task_fresh(make, said):
    w = make({"launch": {"pid": 99}})
    w.task.start({"candidates": []}, w.env, w.srun_relay)
    assert w.agent.ops() == ["launch"] and w.task.root_pid == 99
    assert w.member.events == [("started", {"action": "run"})]
    assert not any("restore" in line for line in said)        # a first start has nothing to say about it


def test_the_newest_committed_epoch_is_restored_and_nothing_is_launched(make, said):
    w = make({"restore": restores(set())})
    w.task.start({"candidates": [image(5), image(4)]}, w.env, w.srun_relay)
    assert w.agent.calls == [("restore", {"epoch": 5, "nfds": 3})] and w.task.root_pid == 4242
    assert w.member.events == [("started", {"action": "restore"})]
    assert any("restored from checkpoint epoch 5" in line for line in said)


def test_a_failed_restore_falls_back_to_the_previous_epoch(make, said):
    w = make({"restore": restores({5})})
    w.task.start({"candidates": [image(5), image(4)]}, w.env, w.srun_relay)
    assert [a["epoch"] for op, a in w.agent.calls if op == "restore"] == [5, 4] and "launch" not in w.agent.ops()
    assert w.task.root_pid == 4242
    assert any("epoch 5" in line and "FAILED" in line for line in said)     # never silent
    # said again after the restore: restoring epoch 4 put back its output, which ends before the FAILED line
    # (seen on the GPU machine: the job's output said only "restored from checkpoint epoch 1")
    assert "restored from checkpoint epoch 4" in said[-2]
    assert said[-1].startswith("epoch 4 was restored because newer checkpoints could not be: epoch 5: ")


def test_a_fallback_after_an_error_without_text_still_names_it(make, said):
    w = make({"restore": lambda args: RestoreError("") if args["epoch"] == 5 else {"pid": 7, "kind": "image"}})
    w.task.start({"candidates": [image(5), image(4)]}, w.env, w.srun_relay)
    assert said[-1] == "epoch 4 was restored because newer checkpoints could not be: epoch 5: RestoreError"


def test_when_no_epoch_restores_the_task_starts_fresh_and_says_so(make, said):
    w = make({"restore": restores({5, 4}), "launch": {"pid": 99}})
    w.task.start({"candidates": [image(5), image(4)]}, w.env, w.srun_relay)
    assert w.agent.ops() == ["restore", "restore", "launch"] and w.task.root_pid == 99
    assert [e for e, _ in w.member.events] == ["started", "started", "started"]
    assert w.member.events[-1] == ("started", {"action": "run"})
    assert any("from the beginning" in line for line in said)


def test_a_rank_sharing_its_cut_withdraws_the_epoch_for_the_job_instead_of_falling_back(make, said, slurm):
    """Other ranks restore the same epoch: falling back alone would leave the job at no common cut. The
    epoch is rejected for every rank, the coordinator told, the job requeued; nothing is launched."""
    w = make({"restore": restores({5})}, tasks=2, connected=True)
    w.task.start({"candidates": [image(5), image(4)]}, w.env, w.srun_relay)
    assert w.agent.ops() == ["restore", "reject_epoch"]
    assert w.agent.calls[1][1]["epoch"] == 5 and "criu restore" in w.agent.calls[1][1]["reason"]
    assert ("withdrawn", {"epoch": 5}) in w.member.events
    assert w.task.awaiting_requeue and slurm.requeued == [7] and w.task.root_pid is None


def test_a_completed_rank_is_not_rerun(make, said):
    w = make()
    w.task.start({"candidates": [{"epoch": 5, "kind": "completed", "exit_code": 3}]}, w.env, w.srun_relay)
    assert w.agent.ops() == [] and w.task.completed_code == 3
    assert w.member.events == [("started", {"action": "skip"})]


def test_a_replayed_batch_step_relaunches_with_its_output_held_back(make):
    """A batch step that ran srun at the capture is replayed: its output is restored, the script re-run
    through relays that discard what it prints until a step resumes."""
    w = make({"restore": {"kind": "replay"}, "launch": {"pid": 98}}, connected=False)
    w.task.start({"candidates": [{"epoch": 5, "kind": "replay"}]}, w.env, w.srun_relay)
    assert w.agent.ops() == ["restore", "launch"] and w.agent.calls[1][1]["nfds"] == 3
    assert not w.task.gate.is_set() and w.task.root_pid == 98
    w.task.rank_started("0.0", "restore")
    assert w.task.gate.is_set()


# ---- signals ---------------------------------------------------------------------------------------------
def test_sigterm_asks_for_a_final_capture_and_is_not_forwarded(make, tree):
    w = make()
    w.task.root_pid = tree.pid
    w._on_signal(signal.SIGTERM)
    assert w.member.triggers == [("sigterm", True)]
    time.sleep(0.1)
    assert tree.poll() is None


def test_sigterm_after_the_final_commit_asks_for_nothing(make, tree):
    w = make()
    w.task.root_pid = tree.pid
    w.epochs.final_committed.set()
    w._on_signal(signal.SIGTERM)
    assert w.member.triggers == [] and tree.poll() is None


def test_a_failed_final_capture_passes_slurms_sigterm_on_to_the_tree(make, said, tree, tmp_path: Path):
    """Slurm's SIGTERM was held back for the final capture; when that capture aborts, every process of the
    tree gets it (as without slurmckpt), and the job's output says so. A failed periodic capture or a
    failed manual requeue signals nothing."""
    w = make()
    w.task.root_pid = tree.pid
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{tree.pid}\n")
    w.tree_procs = str(procs)
    aborted = {"status": "aborted", "epoch": 4, "stage": "gpu-lock", "rank": "batch.0", "error": "refused"}
    w.epochs.epoch_result(aborted, "interval", False)
    w.epochs.epoch_result(aborted, "manual-requeue", True)
    time.sleep(0.1)
    assert tree.poll() is None
    w.epochs.epoch_result(aborted, "sigterm", True)
    assert tree.wait(5) == -signal.SIGTERM
    assert any("passing Slurm's SIGTERM on to the program" in line for line in said)


def test_a_periodic_capture_that_raced_a_tasks_end_is_not_news_a_final_one_is(make, said):
    """error_kind "ended" (a rank's tree ended as the capture began): a periodic epoch aborted so prints
    nothing and reports nothing (the next capture goes on without the rank); a final one is said as any."""
    w = make()
    ended = {"status": "aborted", "epoch": 4, "stage": "size", "rank": "0.1", "error": "no running task tree to "
             "capture", "error_kind": "ended"}
    w.epochs.epoch_result(ended, "interval", False)
    assert not any("ABORTED" in line for line in said) and w.agent.ops() == []
    w.epochs.epoch_result(ended, "manual-requeue", True)
    assert any("epoch 4 (manual-requeue) ABORTED" in line for line in said)


def test_sigterm_passed_on_reaches_the_root_child_only_after_the_others(make, tmp_path: Path):
    """The namespace init ends with its root child and takes every process with it, so the root child
    (and the init) get the passed-on SIGTERM only once the others have ended (or after the grace)."""
    def default_signals() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    root = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], preexec_fn=default_signals)   # init, root child
    other = subprocess.Popen(["sh", "-c", "trap 'sleep 0.5; exit 3' TERM; sleep 60 & wait"], preexec_fn=default_signals)
    try:
        time.sleep(0.3)
        w = make()
        w.task.root_pid = root.pid
        procs = tmp_path / "cgroup.procs"
        procs.write_text(f"{root.pid}\n{other.pid}\n")
        w.tree_procs = str(procs)
        start = time.monotonic()
        w._pass_sigterm_on(grace_s=5)
        assert other.wait(5) == 3 and root.wait(5) == -signal.SIGTERM
        assert time.monotonic() - start >= 0.5        # the root waited for the other's handler
    finally:
        for p in (root, other):
            if p.poll() is None:
                p.kill()
            p.wait()


def test_capture_signals_ask_for_captures(make):
    w = make()
    w._on_signal(wrapper.CHECKPOINT_SIGNAL)
    w._on_signal(wrapper.REQUEUE_SIGNAL)
    w._on_signal(signal.SIGCHLD)
    assert w.member.triggers == [("manual", False), ("manual-requeue", True)]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT, signal.SIGHUP])
def test_other_signals_are_forwarded_to_the_tree(make, tree, sig):
    w = make()
    w.task.root_pid = tree.pid
    w._on_signal(sig)
    assert tree.wait(5) == -sig and w.member.triggers == []


def test_a_committed_final_capture_for_walltime_requeues_the_job(make, slurm):
    w = make()
    result = {"status": "committed", "epoch": 3, "ranks": 1, "bytes": 0, "commit_s": 0.5}
    w.epochs.epoch_result(result, "interval", False)
    w.epochs.epoch_result(result, "walltime", True)
    deadline = time.monotonic() + 5
    while not slurm.requeued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slurm.requeued == [7]


# ---- the agent gone ---------------------------------------------------------------------------------------
def test_a_lost_agent_is_said_once_and_the_call_fails_typed(make, said):
    w = make({"prepare": EOFError("peer closed the channel"), "resume": OSError("broken pipe")})
    with pytest.raises(SlurmckptError, match="agent is gone"):
        w.call("prepare", epoch=1)
    with pytest.raises(SlurmckptError):
        w.call("resume", epoch=1)
    assert w.agent_gone and len([line for line in said if "agent died" in line]) == 1


def test_closing_the_agent_on_purpose_is_not_a_loss(make, said):
    w = make({"hello": EOFError("peer closed the channel")})
    w.ending = True
    with pytest.raises(SlurmckptError):
        w.call("hello")
    assert not w.agent_gone and said == []


def test_sigterm_without_an_agent_ends_the_tree_like_a_plain_task(make, tree, tmp_path: Path):
    """No capture is possible: the whole tree (its cgroup's pids) gets SIGTERM, and the job's final epoch is
    still asked for (it aborts: the previous commit stays)."""
    w = make()
    w.task.root_pid, w.agent_gone = tree.pid, True
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{tree.pid}\n")
    w.tree_procs = str(procs)
    w._on_signal(signal.SIGTERM)
    assert tree.wait(5) == -signal.SIGTERM and w.member.triggers == [("sigterm", True)]


def test_the_task_ending_without_an_agent_kills_what_is_left_of_the_tree(make, tree, tmp_path: Path):
    w = make()
    w.agent_gone = True
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{tree.pid}\n")
    w.tree_procs = str(procs)
    assert w._exit(5) == 5
    assert tree.wait(5) == -signal.SIGKILL and w.member.closed == [(5, True)]


def test_a_program_ended_by_the_sigterm_passed_on_is_not_reported_as_completed(make, tree, tmp_path: Path):
    """Recorded as completed, a later capture would restore that rank as its exit code while its peers
    restore mid-run: after the wrapper passed SIGTERM on, the task only leaves the job."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{tree.pid}\n")
    w = make()
    w.task.root_pid, w.agent_gone, w.tree_procs = tree.pid, True, str(procs)
    w._on_signal(signal.SIGTERM)
    assert tree.wait(5) == -signal.SIGTERM
    w._exit(143)
    assert w.member.closed == [(143, False)]


def test_after_a_failed_final_capture_the_program_is_not_reported_as_completed(make, tree, tmp_path: Path):
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{tree.pid}\n")
    w = make()
    w.task.root_pid, w.tree_procs = tree.pid, str(procs)
    w._pass_sigterm_on(grace_s=0.5)
    assert tree.wait(5) == -signal.SIGTERM
    w._exit(143)
    assert w.member.closed == [(143, False)]


def test_a_tree_its_agent_killed_is_not_reported_as_completed(make, said):
    """An agent that killed the tree (a process lost its GPU state) says so when asked: the task only
    leaves the job, and the job's stderr says why and how to restore the previous checkpoint."""
    w = make({"tree_fate": {"killed_for": "a process lost its GPU state in epoch 3"}})
    w._exit(137)
    assert w.member.closed == [(137, False)]
    assert any("killed by slurmckpt (a process lost its GPU state in epoch 3)" in m for m in said)
    w = make()
    w._exit(0)
    assert w.member.closed == [(0, True)] and w.agent.ops() == ["tree_fate"]


# ---- commands from the coordinator ----------------------------------------------------------------------
def test_commands_go_to_the_agent_and_track_the_final_capture(make):
    w = make({"capture": {"ok": True, "kind": "image", "bytes": 10}})
    assert w.epochs.on_command("capture", 4, {"final": True}) == {"kind": "image", "bytes": 10}
    assert w.epochs.final_capture.is_set() and w.agent.calls[-1] == ("capture", {"epoch": 4, "final": True, "nfds": 0})
    w.epochs.on_command("abort", 4, {})
    assert not w.epochs.final_capture.is_set()
    w.epochs.on_command("finish", 4, {})
    assert w.epochs.final_committed.is_set()


def test_a_contended_lock_reaches_the_coordinator_client_as_its_type(make):
    """The agent's LockContended is raised again here, so RankClient reports it as error_kind retryable."""
    w = make({"prepare": LockContended("GPU lock of pid 7 timed out after 500 ms")})
    with pytest.raises(LockContended):
        w.epochs.on_command("prepare", 4, {})


# ---- the site policy, as the agent's plan says it -------------------------------------------------------------
def test_the_policys_interval_replaces_the_shims_and_is_said(make, said):
    w = make()
    w.env = w.member.env = w.env.__class__(**{**w.env.__dict__, "interval_s": 10})
    w.env = w.member.env = with_interval({"interval_s": 600, "policy": {"min_interval_s": 600,
                                                                       "min_interval_from": "partition low"}},
                                         w.env, w._say)
    assert w.env.interval_s == 600 and w.member.env.interval_s == 600
    assert said == ["checkpoint interval 600s, set by the site policy (partition low)"]
    w.env = with_interval({"interval_s": 600}, w.env, w._say)                    # the same again: nothing to say
    assert len(said) == 1


def test_a_disabled_task_becomes_its_plain_command_without_the_private_variables(make, said, monkeypatch):
    w = make()
    ran: list = []
    monkeypatch.setenv("SLURMCKPT_AGENT_FD", "3")
    monkeypatch.setenv("SLURMCKPT_INTERVAL", "600")
    monkeypatch.setattr(wrapper.os, "execvpe", lambda path, argv, env: ran.append((path, argv, env)))

    class Libc:
        def prctl(self, *args):
            ran.append(("prctl", args))
    w._run_plainly(Libc(), "checkpoints are not allowed in partition debug (site policy)")
    assert said == ["checkpoints are not allowed in partition debug (site policy): running the task without "
                    "checkpoints"]
    assert ran[0] == ("prctl", (wrapper.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0))
    path, argv, env = ran[1]
    assert (path, argv) == ("app", ["app"]) and not any(k.startswith("SLURMCKPT_") for k in env)


def test_size_notes_go_to_the_jobs_stderr_once_and_not_to_the_coordinator(make, said):
    note = "pid 11 (JAX) holds 105.3 GiB ... Set XLA_PYTHON_CLIENT_PREALLOCATE=false for the job"
    w = make({"size": {"ok": True, "gpu_bytes": 5, "notes": [note]}})
    for epoch in (4, 5):
        assert w.epochs.on_command("size", epoch, {"final": False, "trigger": "interval"}) == {"gpu_bytes": 5}
    assert said == [f"note: {note}"]
    assert w.agent.calls[0] == ("size", {"epoch": 4, "final": False, "trigger": "interval", "nfds": 0})


def test_the_coordinators_capture_timeout_bounds_the_wait_for_a_final_commit(make):
    w = make({"capture": {"kind": "image"}})
    w.epochs.on_command("capture", 4, {"final": True, "timeout_s": 1800.0})
    assert w.epochs.capture_timeout_s == 1800.0
    w.epochs.on_command("capture", 5, {"final": True, "timeout_s": 1.0})        # never below the configured floor
    assert w.epochs.capture_timeout_s == w.config.capture_timeout_s


@pytest.mark.parametrize("env, added", [
    ({"CUDA_VISIBLE_DEVICES": "0"}, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}),
    ({"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}),
    ({}, {}),                                                       # no GPU: the environment is left alone
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, {})])
def test_gpu_tasks_start_with_memory_on_demand_unless_the_job_chose(make, said, monkeypatch, env, added):
    for name in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR", "TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    w = make({"launch": {"pid": 99}})
    w.task.launch(w.env, w.srun_relay, relay=False)
    launched = w.agent.calls[-1][1]["env"]
    assert {k: launched[k] for k in added} == added
    assert not ({"XLA_PYTHON_CLIENT_PREALLOCATE", "TF_FORCE_GPU_ALLOW_GROWTH"} - set(added)) & set(launched)
    assert env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") == launched.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert bool(added) == any("checkpointable GPU job: set" in line for line in said)


def test_every_task_starts_with_pytorchs_store_off_libuv_and_gpu_tasks_with_checkpointable_nccl(make, monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "USE_LIBUV", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    w = make({"launch": {"pid": 99}})
    w.task.launch(w.env, w.srun_relay, relay=False)
    env = w.agent.calls[-1][1]["env"]
    assert env["USE_LIBUV"] == "0" and "NCCL_P2P_DISABLE" not in env      # a CPU task: no NCCL settings
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")                        # the job's own choice stands
    w.task.launch(w.env, w.srun_relay, relay=False)
    env = w.agent.calls[-1][1]["env"]
    assert (env["NCCL_P2P_DISABLE"], env["NCCL_SHM_DISABLE"], env["NCCL_NVLS_ENABLE"]) == ("0", "1", "0")
    w.task.config = Config(nccl_checkpoint_transports=False, torch_store_without_libuv=False)
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    w.task.launch(w.env, w.srun_relay, relay=False)
    env = w.agent.calls[-1][1]["env"]
    assert not {"USE_LIBUV", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"} & set(env)


GPU_ENV = ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_LOCALID", "NCCL_P2P_DISABLE",
           "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "SLURMCKPT_CFG_NCCL_MULTI_GPU",
           "CUDA_CHECKPOINT_JOB_FILE")


def test_a_job_with_several_gpus_on_a_node_is_told_the_nccl_trade_and_can_choose_nvlink(make, said, monkeypatch):
    """Four GPUs of the job on the node (one seen by the task, --gpus-per-task): NCCL's intra-node transports
    are turned off only as the site's explicit choice, and the job's output says what that costs; the job's
    own choice keeps NVLink (docs/gpu.md, "NCCL on a node with several GPUs")."""
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    w = make({"launch": {"pid": 99}})
    w.task.launch(w.env, w.srun_relay, relay=False)
    env = w.agent.calls[-1][1]["env"]
    assert (env["NCCL_P2P_DISABLE"], env["NCCL_SHM_DISABLE"], env["NCCL_NVLS_ENABLE"]) == ("1", "1", "0")
    [trade] = [line for line in said if "GPUs of this job on node" in line]
    assert trade.startswith("4 GPUs of this job on node n1: NCCL's intra-node transports are off") and "1/82" in trade
    said.clear()
    monkeypatch.setenv("SLURMCKPT_CFG_NCCL_MULTI_GPU", "nvlink")
    w.task.launch(w.env, w.srun_relay, relay=False)
    env = w.agent.calls[-1][1]["env"]
    assert not {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"} & set(env)
    assert any(line.startswith("4 GPUs of this job on node n1: NCCL keeps NVLink (the job's choice") for line in said)
    said.clear()
    monkeypatch.setenv("SLURM_LOCALID", "1")                       # the node's other tasks say nothing
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert not any("GPUs of this job on node" in line for line in said)


def test_a_step_started_from_the_batch_script_chooses_again_what_the_batch_wrapper_added(make, said, monkeypatch):
    """A step inherits the batch task's environment, with what slurmckpt added there (SLURMCKPT_ADDED): not
    the job's own values, so a step that keeps NVLink gets none of them; a value the job changed stands."""
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    w = make({"launch": {"pid": 99}})
    w.task.launch(w.env, w.srun_relay, relay=False)
    batch = w.agent.calls[-1][1]["env"]
    assert batch["SLURMCKPT_ADDED"].split() == sorted(f"{k}={v}" for k, v in batch.items()
                                                      if k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
                                                               "NCCL_NVLS_ENABLE", "USE_LIBUV",
                                                               "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                               "TF_FORCE_GPU_ALLOW_GROWTH"))
    for k, v in batch.items():                                   # the step's environment: the batch task's
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NCCL_SHM_DISABLE", "0")                   # ... which the job changed for one variable
    monkeypatch.setenv("SLURMCKPT_CFG_NCCL_MULTI_GPU", "nvlink")
    w.task.launch(w.env, w.srun_relay, relay=False)
    step = w.agent.calls[-1][1]["env"]
    assert "NCCL_P2P_DISABLE" not in step and "NCCL_NVLS_ENABLE" not in step and step["NCCL_SHM_DISABLE"] == "0"
    assert step["USE_LIBUV"] == "0" and "NCCL" not in step["SLURMCKPT_ADDED"]


def test_gpu_tasks_start_in_a_cuda_checkpoint_job_where_the_site_and_the_driver_allow(make, said, monkeypatch):
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    w = make({"launch": {"pid": 99}})
    w.task.config = Config(cuda_checkpoint_launch="/usr/bin/cuda-checkpoint")
    monkeypatch.setattr(task_start, "driver_release", lambda: (610, 57, 4))
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert w.agent.calls[-1][1]["argv"] == ["/usr/bin/cuda-checkpoint", "--launch-job", "app"]
    assert any("started under /usr/bin/cuda-checkpoint --launch-job" in line for line in said)
    monkeypatch.setattr(task_start, "driver_release", lambda: (580, 159, 4))
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert w.agent.calls[-1][1]["argv"] == ["app"]


def test_the_launch_carries_the_jobs_io_uring_opt_out_and_a_bad_value_is_said(make, said, monkeypatch):
    monkeypatch.delenv("SLURMCKPT_IO_URING", raising=False)
    w = make({"launch": {"pid": 99}})
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert w.agent.calls[-1][1]["allow_io_uring"] is False
    monkeypatch.setenv("SLURMCKPT_IO_URING", "allow")
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert w.agent.calls[-1][1]["allow_io_uring"] is True
    assert w.agent.calls[-1][1]["env"]["SLURMCKPT_IO_URING"] == "allow"      # the job's variable, left as it is
    monkeypatch.setenv("SLURMCKPT_IO_URING", "on")
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert w.agent.calls[-1][1]["allow_io_uring"] is False
    assert any("SLURMCKPT_IO_URING='on' is neither allow nor block" in line for line in said)


def test_the_growth_defaults_can_be_turned_off(make, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    w = make({"launch": {"pid": 99}})
    w.task.config = Config(gpu_growth_defaults=False)
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in w.agent.calls[-1][1]["env"]


def test_only_rank_0_of_a_step_says_it_set_the_growth_defaults(make, said, monkeypatch):
    import dataclasses
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    for name in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    w = make({"launch": {"pid": 99}})
    w.env = dataclasses.replace(w.env, rank=1)
    w.task.launch(w.env, w.srun_relay, relay=False)
    assert w.agent.calls[-1][1]["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert not any("checkpointable GPU job" in line for line in said)


def test_automatic_interval_choices_are_said_when_they_change_and_recorded_newest_last(make, said):
    """The coordinator's choices come in order on its link; the agent records them off the link, one at a
    time, and a choice that comes while one is being recorded replaces any still waiting: the store ends with
    the newest."""
    import threading
    import time as _time
    gate, entered = threading.Event(), threading.Event()
    recorded: list[int] = []

    def record(args: dict) -> dict:
        entered.set()
        gate.wait(5)
        recorded.append(args["choice"]["interval_s"])
        return {}
    w = make({"interval_chosen": record})
    w.epochs.interval_chosen({"interval_s": 600}, "checkpoint interval auto: 600s (no capture measured yet)", True)
    assert entered.wait(5)                       # the first one is being recorded
    for seconds in (40, 41, 42):
        w.epochs.interval_chosen({"interval_s": seconds}, f"checkpoint interval auto: {seconds}s", seconds == 40)
    gate.set()
    deadline = _time.monotonic() + 5
    while (w.epochs.choice_recorder or not recorded) and _time.monotonic() < deadline:
        _time.sleep(0.01)
    assert recorded == [600, 42]
    assert said == ["checkpoint interval auto: 600s (no capture measured yet)", "checkpoint interval auto: 40s"]


# ---- the time Slurm gives a final capture (docs/operations.md) -----------------------------------------------
def test_the_restore_line_says_what_the_requeue_cost_and_the_trigger_age_reaches_the_agent(make, said):
    w = make({"restore": restores(set()), "size": {"ok": True, "host_bytes": 5}})
    cost = "taken 40 s before the requeue; the final capture (epoch 6) was not taken: final capture needs ~45 s"
    w.task.start({"candidates": [{**image(5), "cost": cost}]}, w.env, w.srun_relay)
    assert re.fullmatch(r"restored from checkpoint epoch 5 in [\d.]+s \(restart 1\): " + re.escape(cost), said[-1])
    w.epochs.on_command("size", 7, {"final": True, "trigger": "sigterm", "trigger_age_s": 1.5})
    assert w.agent.calls[-1] == ("size", {"epoch": 7, "final": True, "trigger": "sigterm", "trigger_age_s": 1.5,
                                          "nfds": 0})


def test_a_final_capture_handed_over_and_one_not_taken_are_said_as_such(make, said):
    from slurmckpt.task.epochs import abort_message
    w = make()
    w.epochs.epoch_result({"status": "committed", "persisting": True, "epoch": 6, "ranks": 2, "bytes": 2 * 2**30,
                     "commit_s": 3.2, "cut_s": 0.01}, "sigterm", True)
    assert said[-1].startswith("checkpoint epoch 6 captured (sigterm): 2 rank(s), 2048.0 MiB in staging, "
                               "frozen->handed over 3.20s") and said[-1].endswith("persisted to the image store and "
                                                                                  "committed after the job ends (its "
                                                                                  "restore waits for that)")
    assert abort_message({"epoch": 7, "rank": "batch.0", "node": "n1", "stage": "window",
                          "error": "final capture skipped: ..."}, "sigterm") == (
        "checkpoint epoch 7 (sigterm) NOT TAKEN (rank batch.0, node n1, stage window): final capture skipped: ...; "
        "the previous checkpoint stays the one restored")


# ---- a failed final capture: every rank passes Slurm's SIGTERM on ----------------------------------------
@pytest.mark.parametrize("order", ["sigterm-first", "word-first"])
def test_the_coordinators_word_of_a_failed_final_capture_passes_sigterm_on_in_either_order(make, tree, said,
                                                                                         tmp_path: Path, order):
    """A rank that is not the coordinator's host never sees the epoch's result: without the coordinator's
    word it held Slurm's SIGTERM until KillWait's SIGKILL. Its own SIGTERM and the word may come in either
    order; the agent is not asked anything for the word."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{tree.pid}\n")
    w = make()
    w.task.root_pid, w.tree_procs = tree.pid, str(procs)
    if order == "sigterm-first":
        w._on_signal(signal.SIGTERM)
        assert w.member.triggers == [("sigterm", True)] and tree.poll() is None
        assert w.epochs.on_command("pass-sigterm", 3, {}) == {}
    else:
        assert w.epochs.on_command("pass-sigterm", 3, {}) == {}
        assert tree.poll() is None           # no SIGTERM from Slurm here (yet): nothing to pass on
        w._on_signal(signal.SIGTERM)
        assert w.member.triggers == []       # the job's final capture already failed: no new one asked
    assert tree.wait(5) == -signal.SIGTERM
    assert "pass-sigterm" not in w.agent.ops() and w.passed_sigterm_on
    assert sum("final capture failed: passing Slurm's SIGTERM on" in line for line in said) == 1


def test_the_sigterm_is_passed_on_once_however_often_it_is_asked(make, tmp_path: Path):
    w = make()
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    w.tree_procs = str(procs)
    sent: list[list[int] | None] = []
    w._signal_tree = lambda sig, pids=None: sent.append(pids)
    w._pass_sigterm_on(grace_s=0)
    w._pass_sigterm_on(grace_s=0)
    assert len(sent) == 2          # one pass: the others, then the root child and init


def test_the_coordinators_host_says_the_failed_final_capture_once(make, said, tmp_path: Path):
    """The host's wrapper says it with the epoch's result (epochs.epoch_result); the coordinator's word to it
    as a rank adds no second line."""
    w = make()
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    w.tree_procs, w.member.supervisor = str(procs), object()
    w._on_signal(signal.SIGTERM)
    w.epochs.on_command("pass-sigterm", 3, {})
    w.epochs.epoch_result({"status": "aborted", "epoch": 3, "stage": "prepare", "error": "x"}, "sigterm", True)
    time.sleep(0.2)
    assert sum("passing Slurm's SIGTERM on" in line for line in said) == 1 and w.passed_sigterm_on


def test_a_signal_for_a_root_not_yet_the_users_is_tried_again_and_never_raises(monkeypatch) -> None:
    """Right after the launch the task's root is still the root agent's fork (EPERM for the user's wrapper):
    a signal then (scancel's SIGCONT, a user's SIGINT) is tried again until it goes; one that never can is
    logged, and a process gone is nothing to do. Seen in CI as a traceback in the job's output."""
    sent: list[tuple[int, int]] = []
    refusals = iter([PermissionError(1, "not yet"), PermissionError(1, "not yet")])

    def kill(pid: int, sig: int) -> None:
        refusal = next(refusals, None)
        if refusal:
            raise refusal
        sent.append((pid, sig))
    monkeypatch.setattr(wrapper.os, "kill", kill)
    wrapper.pass_signal(4242, signal.SIGCONT)
    assert sent == [(4242, signal.SIGCONT)]

    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(1, "another user's")
    monkeypatch.setattr(wrapper.os, "kill", refuse)
    monkeypatch.setattr(wrapper, "PASS_ON_RETRY_S", 0.05)
    started = time.monotonic()
    wrapper.pass_signal(4242, signal.SIGINT)
    assert time.monotonic() - started >= 0.05

    def gone(pid: int, sig: int) -> None:
        raise ProcessLookupError(3, "gone")
    monkeypatch.setattr(wrapper.os, "kill", gone)
    wrapper.pass_signal(4242, signal.SIGINT)
