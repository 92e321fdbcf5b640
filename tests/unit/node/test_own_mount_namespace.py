"""A GPU tree's own PID + mount namespace: its /proc, the keys of files it holds through the node's mounts,
and the criu options that dump and restore such a tree."""
from __future__ import annotations

import pytest

import os
from pathlib import Path

from slurmckpt.node import launch
from slurmckpt.node import proctree
from slurmckpt.criu.driver import CriuDriver, InheritedFd
from smallfs import require_root


def target(link: str, mnt_id: int, ino: int = 0x2a, fd: int = 1) -> proctree.FdTarget:
    return proctree.FdTarget(fd, link, True, 10, True, 0, ino, False, mnt_id)


def test_files_held_through_a_mount_outside_the_namespace_get_an_external_key() -> None:
    view = proctree.MountView(frozenset({100, 101}))
    assert view.key(target("/var/tmp/slurm-7.out", 27, 0x20c0d6)) == "file[1b:20c0d6]"
    assert view.key(target("/dev/null", 24, 3)) == "file[18:3]"
    assert view.key(target("/home/u/data.txt", 101)) == "home/u/data.txt"         # opened inside
    assert view.key(target("/memfd:slurmckpt-env (deleted)", 5)) == "memfd:slurmckpt-env (deleted)"
    assert view.key(target("pipe:[77]", 13)) == "pipe:[77]"


def test_a_tree_in_the_nodes_mount_namespace_keeps_path_keys() -> None:
    assert proctree.MountView().key(target("/var/tmp/slurm-7.out", 27)) == "var/tmp/slurm-7.out"
    assert proctree.mount_view(os.getpid()).inside is None


def fake_criu(tmp_path: Path) -> tuple[CriuDriver, Path]:
    args = tmp_path / "args"
    binary = tmp_path / "criu"
    binary.write_text("#!/bin/sh\n"
                      f"printf '%s\\n' \"$@\" > {args}\n"
                      "while [ $# -gt 0 ]; do [ \"$1\" = --pidfile ] && echo 4242 > \"$2\"; shift; done\n")
    binary.chmod(0o755)
    return CriuDriver(binary=str(binary)), args


def test_criu_dumps_and_restores_an_own_mount_namespace_on_the_nodes_mounts(tmp_path: Path) -> None:
    criu, args = fake_criu(tmp_path)
    criu.dump(1, tmp_path, leave_running=True, freezer=None, external=["file[1b:20c0d6]"], mntns=True)
    dumped = args.read_text().split("\n")
    assert "--ext-mount-map" in dumped and dumped[dumped.index("--ext-mount-map") + 1] == "auto"
    assert {"--enable-external-sharing", "--enable-external-masters"} <= set(dumped)
    assert dumped[dumped.index("--external") + 1] == "file[1b:20c0d6]"
    assert "--root" not in dumped
    r, w = os.pipe()
    try:
        assert criu.restore(tmp_path, [InheritedFd("file[1b:20c0d6]", w)], freezer=None, mntns=True) == 4242
    finally:
        os.close(r)
        os.close(w)
    restored = args.read_text().split("\n")
    assert restored[restored.index("--root") + 1] == "/"
    assert "--ext-mount-map" in restored and f"fd[{w}]:file[1b:20c0d6]" in restored
    criu.dump(1, tmp_path, leave_running=True, freezer=None)
    assert "--ext-mount-map" not in args.read_text().split("\n")


@pytest.mark.system
def test_pid_1_of_the_new_namespaces_sees_its_own_proc_and_the_node_keeps_its_own(tmp_path: Path) -> None:
    require_root()
    out = tmp_path / "out"
    with open(out, "w") as f:
        f.write("x")
    before = Path("/proc/self/mountinfo").read_text()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            launch.unshare_namespaces(own_mntns=True)
            init = os.fork()
            if init == 0:
                try:
                    launch.mount_own_proc()
                    fd = os.open(out, os.O_WRONLY)
                    launch.append_only([fd])
                    os.write(fd, b"y")
                    pids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
                    ok = os.readlink("/proc/self") == "1" and pids == [1] and os.fstat(fd).st_size == 2
                    os._exit(0 if ok else 3)
                except BaseException:  # noqa: BLE001
                    os._exit(2)
            code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    assert Path("/proc/self/mountinfo").read_text() == before        # nothing leaked into the node's namespace
    assert out.read_text() == "xy"                                   # appended, not written at offset 0


def test_copies_of_mounts_that_only_receive_propagation_are_the_ones_made_private() -> None:
    mountinfo = [
        "24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        "153 24 0:4 / /run/netns rw master:1 - tmpfs tmpfs rw",
        "160 24 0:50 / /var/lib/slurmckpt/images rw shared:7 master:3 - fuse.glusterfs srv:/v rw",
        "161 24 0:51 / /mnt/with\\040space rw master:9 - tmpfs tmpfs rw",
        "162 24 0:52 / /scratch rw - xfs /dev/sdb rw",
    ]
    assert launch.slave_only_mount_points(mountinfo) == ["/run/netns", "/mnt/with space"]
