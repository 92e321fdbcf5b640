"""Compression of stored images as a wrapping writer/reader: the store only sees `Codec.encode` (raw bytes
in, stored bytes out through a `Sink` that hashes and counts them) and `Codec.decode` (the reverse).

zstd (python `zstandard`) streams frame by frame: neither side holds more than a few frames in memory or
writes a second copy of a file. A stored file is a standard .zst file (`zstd -d` reads it); the store keeps
an xxh3 over its stored bytes, checked as they are read back.
"""
from __future__ import annotations

import os
import queue
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Protocol, TypeVar

import xxhash

from slurmckpt.store.durable import write_all
from slurmckpt.config import ZSTD_MAX_LEVEL, check_compression

CHUNK = 4 << 20
T = TypeVar("T")
U = TypeVar("U")
PROBE = 4 << 20           # bytes of a file compressed on trial before deciding to store it raw
WORTH_IT = 0.97           # a file is compressed only if the trial saves at least 3 %


class Hole(int):
    """So many zero bytes, written as a hole (unpacking into staging: nothing to copy, nothing for CRIU to
    read back but the kernel's zero page)."""


class Sink:
    """A write-only file object over an fd: every byte written in full (durable.write_all), counted and
    hashed (xxh3, what the rank manifest records for the stored file; `hashed=False` where nothing reads
    the hash, as when unpacking: there the stored bytes are what is checked). Takes bytes, a list of
    parts (a raw frame's blocks, written without joining them) or a Hole; whoever writes holes truncates
    the file to `size` at the end."""

    def __init__(self, fd: int, name: str = "", hashed: bool = True) -> None:
        self.fd, self.name = fd, name
        self.hash = xxhash.xxh3_64() if hashed else None
        self.size = 0

    def write(self, data: bytes | memoryview | list[Any] | Hole) -> int:
        if isinstance(data, Hole):
            os.lseek(self.fd, data, os.SEEK_CUR)
            if self.hash is not None:
                self.hash.update(bytes(data))
            self.size += data
            return data
        if isinstance(data, list):
            return sum(self.write(part) for part in data)
        n = write_all(self.fd, data, self.name)
        if self.hash is not None:
            self.hash.update(data)
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def digest(self) -> str:
        assert self.hash is not None, "an unhashed sink has no digest"
        return self.hash.hexdigest()


class Source:
    """A read-only file object that hashes and counts what it hands out (the stored bytes on restore)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.hash = xxhash.xxh3_64()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.account(data)
        return data

    def account(self, data: bytes) -> None:
        """Hash bytes read from `f` directly (a decoder does it off its reading thread, in order)."""
        self.hash.update(data)
        self.size += len(data)

    def digest(self) -> str:
        return self.hash.hexdigest()


class Codec(Protocol):
    name: str          # recorded per file in rank.json
    suffix: str        # of the stored file's name

    def encode(self, src: BinaryIO, sink: Sink, size: int) -> None: ...
    def decode(self, src: BinaryIO | Source, sink: Sink) -> None: ...


@dataclass(frozen=True)
class Plain:
    name: str = "none"
    suffix: str = ""

    def encode(self, src: BinaryIO, sink: Sink, size: int) -> None:
        _copy(src, sink)

    def decode(self, src: BinaryIO | Source, sink: Sink) -> None:
        _copy(src, sink)


@dataclass(frozen=True)
class Zstd:
    """Independent zstd frames of FRAME raw bytes each, compressed by `threads` workers and unpacked by as
    many as the node has CPUs (at most 16). A frame that saves less than 1 - KEEP is written as zstd raw
    blocks (read back at memcpy speed). Before each frame a skippable frame (which `zstd -d` ignores) gives its stored
    and raw size, so frames can be handed to workers without parsing them."""
    level: int = 1
    threads: int = 2
    name: str = "zstd"
    suffix: str = ".zst"

    def encode(self, src: BinaryIO, sink: Sink, size: int) -> None:
        import zstandard
        local = threading.local()

        def pack(chunk: bytes) -> bytes:
            if not hasattr(local, "cctx"):
                local.cctx = zstandard.ZstdCompressor(level=self.level)
            packed = local.cctx.compress(chunk)
            if len(packed) > KEEP * len(chunk):
                packed = raw_frame(chunk)
            return _index(len(packed), len(chunk)) + bytes(packed)
        _in_order(self.threads, iter(lambda: src.read(FRAME), b""), pack, sink.write)

    def decode(self, src: BinaryIO | Source, sink: Sink) -> None:
        import zstandard
        local = threading.local()

        def unpack(item: tuple[bytes, bytes, int]) -> tuple[tuple[bytes, bytes], bytes | list[Any] | Hole]:
            head, frame, raw = item
            blocks = raw_blocks(frame, raw)
            if blocks is not None:
                return (head, frame), blocks        # written as they are stored: no copy
            if not hasattr(local, "dctx"):
                local.dctx = zstandard.ZstdDecompressor()
            try:
                out = local.dctx.decompress(frame, max_output_size=raw)
            except zstandard.ZstdError as e:
                raise ValueError(f"zstd: {e}") from e
            if len(out) != raw:
                raise ValueError(f"a frame unpacks to {len(out)} bytes, its index says {raw}")
            if len(frame) * ZERO_RATIO < raw and out == bytes(raw):
                return (head, frame), Hole(raw)     # zero pages: a hole in the unpacked file
            return (head, frame), out

        # A Source's hash (xxh3, holding the GIL) is taken by the writer thread, not the reading one.
        account = src.account if isinstance(src, Source) else None

        def write(done: tuple[tuple[bytes, bytes], bytes | list[Any] | Hole]) -> None:
            stored, result = done
            if account is not None:
                for part in stored:
                    account(part)
            sink.write(result)
        reader = src.f if isinstance(src, Source) else src
        _in_order(min(os.cpu_count() or 1, MAX_UNPACKERS), _frames(reader), unpack, write)

    def compressible(self, sample: bytes) -> bool:
        """Whether compressing is worth its CPU: random pages (encrypted data, noise) are stored raw."""
        import zstandard
        if not sample:
            return False
        return len(zstandard.ZstdCompressor(level=self.level).compress(sample)) < WORTH_IT * len(sample)


FRAME = 8 << 20                  # raw bytes per independent frame
KEEP = 0.8                       # a frame stays compressed only if it saves 20 %
MAX_UNPACKERS = 16               # threads unpacking one file (each holds two frames in flight)
ZERO_RATIO = 64                  # a frame packed this much smaller may be all zeros: checked, then a hole
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A5E          # RFC 8878: a skippable frame, ignored by every zstd decoder
_INDEX = struct.Struct("<4sQQ")  # b"SCK1", stored bytes of the next frame, raw bytes it unpacks to
_HEAD = struct.Struct("<II")
_BLOCK = 128 << 10               # zstd's largest block


def raw_frame(data: bytes) -> bytes:
    """A standard zstd frame holding `data` as raw blocks (RFC 8878: single segment, 8-byte content size)."""
    out = [struct.pack("<IBQ", _ZSTD_MAGIC, 0xE0, len(data))]
    for start in range(0, max(len(data), 1), _BLOCK):
        block = data[start:start + _BLOCK]
        last = start + _BLOCK >= len(data)
        out += [((len(block) << 3) | last).to_bytes(3, "little"), block]       # Block_Type 0: raw
    return b"".join(out)


def raw_blocks(frame: bytes, raw: int) -> list[memoryview] | None:
    """The data of a frame that `raw_frame` wrote, as views of its raw blocks; None for any other frame
    (zstd then decodes it, and rejects it if it is malformed)."""
    head = struct.calcsize("<IBQ")
    if len(frame) < head or struct.unpack_from("<IBQ", frame) != (_ZSTD_MAGIC, 0xE0, raw):
        return None
    view, pos, parts = memoryview(frame), head, []
    while pos + 3 <= len(frame):
        header = int.from_bytes(view[pos:pos + 3], "little")
        size, last = header >> 3, header & 1
        if (header >> 1) & 3 != 0 or pos + 3 + size > len(frame):
            return None                     # not a raw block, or cut short
        parts.append(view[pos + 3:pos + 3 + size])
        pos += 3 + size
        if last:
            break
    if pos != len(frame) or sum(len(p) for p in parts) != raw:
        return None
    return parts


def _index(stored: int, raw: int) -> bytes:
    return _HEAD.pack(_SKIPPABLE, _INDEX.size) + _INDEX.pack(b"SCK1", stored, raw)


def _frames(src: BinaryIO) -> Iterator[tuple[bytes, bytes, int]]:
    """(index bytes, frame bytes, raw size) of each frame, as stored."""
    def exact(n: int) -> bytes:
        data = src.read(n)
        if len(data) != n:
            raise ValueError(f"truncated: {len(data)} of {n} bytes")
        return data
    while head := src.read(_HEAD.size):
        if len(head) != _HEAD.size:
            raise ValueError("truncated frame index")
        magic, length = _HEAD.unpack(head)
        if magic != _SKIPPABLE or length != _INDEX.size:
            raise ValueError("no frame index where one belongs")
        index = exact(length)
        tag, stored, raw = _INDEX.unpack(index)
        if tag != b"SCK1" or raw > FRAME or stored > FRAME + FRAME // 64 + 1024:
            raise ValueError("bad frame index")
        yield head + index, exact(stored), raw


def _in_order(workers: int, items: Iterable[T], work: Callable[[T], U], out: Callable[[U], object]) -> None:
    """`work` over `items` on `workers` threads (zstd releases the GIL), results handed to `out` in order by
    a writer thread: reading the next items (this thread), working on them and writing earlier results
    overlap, so a restore costs about its slowest side, not the read plus the write. At most 2 x workers
    items are in flight. The first failure (of `items`, `work` or `out`) is raised once the writer stops."""
    done: queue.Queue[Any] = queue.Queue(maxsize=2 * max(1, workers))
    failed: list[BaseException] = []

    def write() -> None:
        while (result := done.get()) is not None:
            if not failed:
                try:
                    out(result.result())
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    failed.append(e)
    writer = threading.Thread(target=write, name="slurmckpt-write", daemon=True)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        writer.start()
        try:
            for item in items:
                if failed:
                    break
                done.put(pool.submit(work, item))
        finally:
            done.put(None)
            writer.join()
    if failed:
        raise failed[0]


PLAIN = Plain()
MAX_LEVEL = ZSTD_MAX_LEVEL


def from_settings(name: str, level: int, threads: int) -> Plain | Zstd:
    """The codec that configuration names (keys `compression`, `compression_level`, `compression_threads`)."""
    check_compression(name, level, threads)
    return PLAIN if name in ("off", "none", "") else Zstd(level, threads)


def for_stored(name: str) -> Plain | Zstd:
    """The codec that decodes a stored file, by the name its rank.json records."""
    if name == "none":
        return PLAIN
    if name == "zstd":
        return Zstd()
    raise ValueError(f"unknown codec {name!r}")


def _copy(src: BinaryIO | Source, sink: Sink) -> None:
    while block := src.read(CHUNK):
        sink.write(block)


def read_sample(path: str, n: int = PROBE) -> bytes:
    """The middle of a file (its head is often headers or zero pages, unlike the rest)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size // 2 - n // 2))
        return f.read(n)
