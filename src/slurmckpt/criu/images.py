"""Reading what criu wrote: the few image records slurmckpt needs, without crit or pycriu.

An image file is two 32-bit magics, then entries, each a 32-bit little-endian length and a protobuf message
(criu/images/*.proto). Only varint and length-delimited fields occur in the messages read here.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

# criu/images/inventory.proto InventoryEntry: dump_criu_run_id = 13
# criu/images/fdinfo.proto FileEntry: type = 1, id = 2, reg = 3; regfile.proto RegFileEntry: id = 1, name = 6
# remap-file-path.proto RemapFilePathEntry: orig_id = 1, remap_id = 2, remap_type = 3 (LINKED = 0)
REMAP_LINKED = 0


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            n, i = _varint(buf, i)
            yield number, buf[i:i + n]
            i += n
        elif wire == 5:
            yield number, struct.unpack_from("<I", buf, i)[0]
            i += 4
        elif wire == 1:
            yield number, struct.unpack_from("<Q", buf, i)[0]
            i += 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")


def _entries(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    i = 8                                    # two magics
    while i + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, i)
        yield data[i + 4:i + 4 + n]
        i += 4 + n


def regular_file_names(images: Path) -> dict[int, str]:
    """files.img: id -> path of every regular-file record."""
    out: dict[int, str] = {}
    if not (images / "files.img").exists():
        return out
    for entry in _entries(images / "files.img"):
        for number, value in _fields(entry):
            if number == 3 and isinstance(value, bytes):
                reg = dict(_fields(value))
                name, ident = reg.get(6), reg.get(1, 0)
                if isinstance(name, bytes) and isinstance(ident, int):
                    out[ident] = name.decode(errors="surrogateescape")
    return out


def linked_remaps(images: Path) -> list[tuple[str, str]]:
    """(name the file had, temporary name criu linked it to) for every file criu dumped with --link-remap:
    a file the tree holds by a name that was removed while another name of it remains."""
    if not (images / "remap-fpath.img").exists():
        return []
    names = regular_file_names(images)
    out = []
    for entry in _entries(images / "remap-fpath.img"):
        rec = dict(_fields(entry))
        orig, remap, kind = rec.get(1), rec.get(2), rec.get(3, REMAP_LINKED)
        if kind == REMAP_LINKED and isinstance(orig, int) and isinstance(remap, int) and orig in names \
                and remap in names:
            out.append((names[orig], names[remap]))
    return out


def dump_run_id(images: Path) -> str | None:
    """The run id criu dumped these images with (inventory.img): criu's nftables network lock is the table
    `inet CRIU-<run id>` (cut to nftables' 31 characters with its family), which a final dump leaves for the
    tree's restore on this node to remove (rank/sharing/netlock.py, `note_criu_lock`)."""
    try:
        entries = list(_entries(images / "inventory.img"))
    except OSError:
        return None
    for entry in entries[:1]:
        for number, value in _fields(entry):
            if number == 13 and isinstance(value, bytes):
                return value.decode(errors="replace")
    return None
