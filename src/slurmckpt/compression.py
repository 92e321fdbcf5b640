"""Compression of stored images as a wrapping writer/reader: the store only sees `Codec.encode` (raw bytes
in, stored bytes out through a `Sink` that hashes and counts them) and `Codec.decode` (the reverse).

zstd (python `zstandard`) streams frame by frame: neither side holds more than a few frames in memory or
writes a second copy of a file. A stored file is a standard .zst file (`zstd -d` reads it); the store keeps
an xxh3 over its stored bytes, checked as they are read back.
"""
from __future__ import annotations

import os
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator, Protocol, TypeVar

import xxhash

from slurmckpt.durable import write_all
from slurmckpt.errors import ConfigError

CHUNK = 4 << 20
T = TypeVar("T")
PROBE = 4 << 20           # bytes of a file compressed on trial before deciding to store it raw
WORTH_IT = 0.97           # a file is compressed only if the trial saves at least 3 %


class Sink:
    """A write-only file object over an fd: every byte written in full (durable.write_all), counted and
    hashed (xxh3, what the rank manifest records for the stored file)."""

    def __init__(self, fd: int, name: str = "") -> None:
        self.fd, self.name = fd, name
        self.hash = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        n = write_all(self.fd, data, self.name)
        self.hash.update(data)
        self.size += n
        return n

    def flush(self) -> None:
        pass

    def digest(self) -> str:
        return self.hash.hexdigest()


class Source:
    """A read-only file object that hashes and counts what it hands out (the stored bytes on restore)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.hash = xxhash.xxh3_64()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def digest(self) -> str:
        return self.hash.hexdigest()


class Codec(Protocol):
    name: str          # recorded per file in rank.json
    suffix: str        # of the stored file's name

    def encode(self, src: BinaryIO, sink: Sink, size: int) -> None: ...
    def decode(self, src: BinaryIO, sink: Sink) -> None: ...


@dataclass(frozen=True)
class Plain:
    name: str = "none"
    suffix: str = ""

    def encode(self, src: BinaryIO, sink: Sink, size: int) -> None:
        _copy(src, sink)

    def decode(self, src: BinaryIO, sink: Sink) -> None:
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
            return _index(len(packed), len(chunk)) + packed
        _in_order(self.threads, iter(lambda: src.read(FRAME), b""), pack, sink.write)

    def decode(self, src: BinaryIO, sink: Sink) -> None:
        import zstandard
        local = threading.local()

        def unpack(item: tuple[bytes, int]) -> bytes:
            frame, raw = item
            if not hasattr(local, "dctx"):
                local.dctx = zstandard.ZstdDecompressor()
            try:
                out = local.dctx.decompress(frame, max_output_size=raw)
            except zstandard.ZstdError as e:
                raise ValueError(f"zstd: {e}") from e
            if len(out) != raw:
                raise ValueError(f"a frame unpacks to {len(out)} bytes, its index says {raw}")
            return out
        _in_order(min(os.cpu_count() or 1, MAX_UNPACKERS), _frames(src), unpack, sink.write)

    def compressible(self, sample: bytes) -> bool:
        """Whether compressing is worth its CPU: random pages (encrypted data, noise) are stored raw."""
        import zstandard
        if not sample:
            return False
        return len(zstandard.ZstdCompressor(level=self.level).compress(sample)) < WORTH_IT * len(sample)


FRAME = 8 << 20                  # raw bytes per independent frame
KEEP = 0.8                       # a frame stays compressed only if it saves 20 %
MAX_UNPACKERS = 16               # threads unpacking one file (each holds two frames in flight)
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


def _index(stored: int, raw: int) -> bytes:
    return _HEAD.pack(_SKIPPABLE, _INDEX.size) + _INDEX.pack(b"SCK1", stored, raw)


def _frames(src: BinaryIO) -> Iterator[tuple[bytes, int]]:
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
        tag, stored, raw = _INDEX.unpack(exact(length))
        if tag != b"SCK1" or raw > FRAME or stored > FRAME + FRAME // 64 + 1024:
            raise ValueError("bad frame index")
        yield exact(stored), raw


def _in_order(workers: int, items: Iterable[T], work: Callable[[T], bytes], out: Callable[[bytes], object]) -> None:
    """`work` over `items` on `workers` threads (zstd releases the GIL), results written in order; at most
    2 x workers items in flight."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= 2 * workers:
                out(pending.popleft().result())
        while pending:
            out(pending.popleft().result())


PLAIN = Plain()
MAX_LEVEL = 19


def from_settings(name: str, level: int, threads: int) -> Plain | Zstd:
    """The codec that configuration names (keys `compression`, `compression_level`, `compression_threads`)."""
    if name in ("off", "none", ""):
        return PLAIN
    if name != "zstd":
        raise ConfigError(f"key 'compression': bad value {name!r}: want zstd or off")
    if not 1 <= level <= MAX_LEVEL:
        raise ConfigError(f"key 'compression_level': bad value {level!r}: want 1..{MAX_LEVEL}")
    if threads < 1:
        raise ConfigError(f"key 'compression_threads': bad value {threads!r}: want >= 1")
    return Zstd(level, threads)


def for_stored(name: str) -> Plain | Zstd:
    """The codec that decodes a stored file, by the name its rank.json records."""
    if name == "none":
        return PLAIN
    if name == "zstd":
        return Zstd()
    raise ValueError(f"unknown codec {name!r}")


def _copy(src: BinaryIO, sink: Sink) -> None:
    while block := src.read(CHUNK):
        sink.write(block)


def read_sample(path: str, n: int = PROBE) -> bytes:
    """The middle of a file (its head is often headers or zero pages, unlike the rest)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size // 2 - n // 2))
        return f.read(n)
