"""Our CRIU patch 0006 with the real criu as CI installs it: after `criu dump --leave-stopped` the tree's TCP
connections work again once it is continued (SIGCONT), as after --leave-running. slurmckpt leaves a tree with
CUDA processes stopped after a periodic dump and continues it after the GPU restore (docs/gpu.md, "The GPU
restore runs while the tree is stopped"); without the patch criu kept the connections in repair mode and the
network locked, and a DDP job over gloo made no step after its first capture on the GPU machine. Needs root
and criu."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CRIU = os.environ.get("SLURMCKPT_CRIU", "/usr/local/sbin/criu")
ECHO = ("import socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
        "while True:\n"
        "    b = s.recv(1)\n"
        "    if not b:\n"
        "        break\n"
        "    s.sendall(b)\n")


def network_lock() -> str:
    return "iptables" if shutil.which("iptables-restore") else "nftables"


def ping(conn: socket.socket, byte: bytes) -> bytes:
    conn.sendall(byte)
    return conn.recv(1)


@pytest.mark.system
def test_a_tree_left_stopped_by_a_dump_has_working_tcp_once_continued(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root (criu dump); CI and `make test` run as root")
    assert os.path.exists(CRIU), f"{CRIU} missing: make setup builds our patched CRIU"
    server = socket.create_server(("127.0.0.1", 0))
    p = subprocess.Popen([sys.executable, "-c", ECHO, str(server.getsockname()[1])], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server.settimeout(10)
        conn, _ = server.accept()
        conn.settimeout(5)
        assert ping(conn, b"a") == b"a"
        images = tmp_path / "images"
        images.mkdir()
        dumped = subprocess.run([CRIU, "dump", "-t", str(p.pid), "-D", str(images), "-o", "dump.log", "-v4",
                                 "--leave-stopped", "--tcp-established", "--shell-job",
                                 "--network-lock", network_lock()], capture_output=True, text=True, timeout=120)
        assert dumped.returncode == 0, (images / "dump.log").read_text()[-3000:]
        deadline = time.monotonic() + 5
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(") ", 1)[1][0] != "T":
            assert time.monotonic() < deadline, "criu did not leave the process stopped"
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGCONT)
        try:
            echoed = ping(conn, b"b")
        except socket.timeout:
            echoed = b"(no answer in 5 s)"
        assert echoed == b"b", "the connection is dead after --leave-stopped and SIGCONT: " \
                               "criu left it in repair mode, or the network locked"
    finally:
        p.kill()
        p.wait()
        server.close()
