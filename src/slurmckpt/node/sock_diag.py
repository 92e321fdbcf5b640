"""The unix sockets of this network namespace, by inode, as `ss -x` shows them: sock_diag over netlink. What a
rank's tree shares (rank/sharing/ipc.py) and whether NCCL built a communicator (cuda/procscan.py) read them."""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class UnixSocket:
    ino: int
    type: int
    name: str = ""      # bound path, "@name" for an abstract one, "" when unbound
    peer: int = 0       # inode of the peer socket (connected sockets), else 0


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_NAME, UDIAG_SHOW_PEER = 0x1, 0x4
UNIX_DIAG_NAME, UNIX_DIAG_PEER = 0, 2


def unix_sockets() -> dict[int, UnixSocket]:
    """Every unix socket of this network namespace, by inode (what `ss -x` shows, through sock_diag)."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_PEER,
                          0xFFFFFFFF, 0xFFFFFFFF)
        nl.sendto(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                  + req, (0, 0))
        out: dict[int, UnixSocket] = {}
        while True:
            data = nl.recv(1 << 20)
            done, found = parse_unix_diag(data)
            out.update(found)
            if done:
                return out


def parse_unix_diag(data: bytes) -> tuple[bool, dict[int, UnixSocket]]:
    """Parse one netlink datagram of a unix sock_diag dump: (dump finished?, sockets)."""
    found: dict[int, UnixSocket] = {}
    off = 0
    while off + 16 <= len(data):
        length, mtype = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if mtype == NLMSG_DONE:
            return True, found
        if mtype == NLMSG_ERROR:
            err = -struct.unpack_from("=i", data, off + 16)[0]
            raise OSError(err, f"sock_diag: {os.strerror(err)}")
        _family, stype, _state, _pad, ino = struct.unpack_from("=BBBBI", data, off + 16)
        name, peer = "", 0
        attr = off + 16 + 16                                    # after struct unix_diag_msg
        while attr + 4 <= off + length:
            alen, atype = struct.unpack_from("=HH", data, attr)
            if alen < 4:
                break
            payload = data[attr + 4:attr + alen]
            if atype == UNIX_DIAG_NAME:
                name = ("@" + payload[1:].decode(errors="replace")) if payload[:1] == b"\0" else \
                    payload.split(b"\0", 1)[0].decode(errors="replace")
            elif atype == UNIX_DIAG_PEER and len(payload) >= 4:
                peer = struct.unpack_from("=I", payload)[0]
            attr += (alen + 3) & ~3
        found[ino] = UnixSocket(ino, stype, name, peer)
        off += (length + 3) & ~3
    return False, found
