"""Compression of stored images as a wrapping writer/reader: the store only sees `Codec.encode` (raw bytes
in, stored bytes out through a `Sink` that hashes and counts them) and `Codec.decode` (the reverse).

zstd (python `zstandard`) streams: neither side holds a file in memory or writes a second copy of it.
Frames carry zstd's own content checksum besides the xxh3 the store keeps over the stored bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, Protocol

import xxhash

from slurmckpt.durable import write_all
from slurmckpt.errors import ConfigError

CHUNK = 4 << 20
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
    level: int = 1
    threads: int = 2
    name: str = "zstd"
    suffix: str = ".zst"

    def encode(self, src: BinaryIO, sink: Sink, size: int) -> None:
        import zstandard
        cctx = zstandard.ZstdCompressor(level=self.level, threads=self.threads, write_checksum=True)
        cctx.copy_stream(src, sink, size=size, read_size=CHUNK, write_size=CHUNK)

    def decode(self, src: BinaryIO, sink: Sink) -> None:
        import zstandard
        try:
            zstandard.ZstdDecompressor().copy_stream(src, sink, read_size=CHUNK, write_size=CHUNK)
        except zstandard.ZstdError as e:
            raise ValueError(f"zstd: {e}") from e

    def compressible(self, sample: bytes) -> bool:
        """Whether compressing is worth its CPU: random pages (encrypted data, noise) are stored raw."""
        import zstandard
        if not sample:
            return False
        return len(zstandard.ZstdCompressor(level=self.level).compress(sample)) < WORTH_IT * len(sample)


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
