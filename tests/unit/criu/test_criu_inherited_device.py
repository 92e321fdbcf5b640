"""Our CRIU patch 0004 (--inherited-device-major) on a CPU process, with the real criu as CI installs it: an fd
on a character device of such a major is dumped as a file and reopened by path at the restore. The GPU case it
exists for (a DataLoader worker forked from a CUDA process keeps the parent's /dev/nvidiactl fds) is proven on the
GPU machine (docs/gpu.md, "Processes forked from a CUDA process"). Here /dev/fuse stands in: like the NVIDIA
control device it refuses lseek (ESPIPE), which failed the GPU machine's restore ("Can't restore file pos:
Illegal seek" on dev/nvidiactl) until the patch dumped such an fd without a position. Needs root and criu."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from criu_processes import kill_all, wait_for_marker

CRIU = os.environ.get("SLURMCKPT_CRIU", "/usr/local/sbin/criu")
DEVICE = "/dev/fuse"              # misc major 10; the test cluster's GlusterFS mounts need it, so CI has it
HOLDER = ("import os, sys, time\n"
          "fd = os.open(sys.argv[1], os.O_RDWR)\n"
          "open(sys.argv[2], 'w').write(str(fd))\n"
          "while True:\n"
          "    time.sleep(0.05)\n")


def misc_major() -> int:
    for line in Path("/proc/devices").read_text().splitlines():
        words = line.split()
        if words[1:] == ["misc"]:
            return int(words[0])
    raise AssertionError("no misc character devices in /proc/devices")


@pytest.fixture
def holder(tmp_path: Path):
    """A process of its own session holding an fd on DEVICE; yields (its Popen, the pids to kill, fd number)."""
    if os.geteuid() != 0:
        pytest.fail("needs root (criu dump and restore); CI and `make test` run as root")
    assert os.path.exists(CRIU), f"{CRIU} missing: make setup builds our patched CRIU"
    assert os.path.exists(DEVICE), f"{DEVICE} missing"
    marker = tmp_path / "fd"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, DEVICE, str(marker)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_marker(marker)
    pids = [p.pid]
    yield p, pids, int(marker.read_text())
    kill_all(p, pids)


def criu(*args: str, log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CRIU, *args, "-v4", "-o", str(log)], capture_output=True, text=True, timeout=120)


@pytest.mark.system
def test_an_fd_on_an_inherited_device_is_reopened_by_path_without_a_position(holder, tmp_path: Path) -> None:
    process, pids, fd = holder
    pid = process.pid
    images = tmp_path / "images"
    images.mkdir()
    refused = criu("dump", "-t", str(pid), "-D", str(images), "--leave-running", log=images / "plain.log")
    assert refused.returncode != 0, "criu dumped a misc-device fd without the patch's flag: the test proves nothing"

    dumped = criu("dump", "-t", str(pid), "-D", str(images), "--inherited-device-major", str(misc_major()),
                  log=images / "dump.log")
    assert dumped.returncode == 0, (images / "dump.log").read_text()[-3000:]
    assert process.wait(timeout=10) == -signal.SIGKILL      # criu ends what it dumped; its pid is free again

    restored = criu("restore", "-D", str(images), "-d", "--pidfile", str(tmp_path / "pid"),
                    log=images / "restore.log")
    assert restored.returncode == 0, (images / "restore.log").read_text()[-3000:]
    new_pid = int((tmp_path / "pid").read_text())
    pids.append(new_pid)
    assert os.readlink(f"/proc/{new_pid}/fd/{fd}") == DEVICE
    time.sleep(0.2)
    assert Path(f"/proc/{new_pid}/stat").read_text().split(")")[1].split()[0] in ("S", "R"), "restored, then died"
