"""One stored prefix: the cache blocks a model needs to resume a sequence at one token boundary, as one file.

A unit is read by another process, another machine, or the same server days later, from storage that can lose
or mangle bytes, so the file carries everything needed to refuse it: the model it belongs to, the digest of the
prefix it holds, and a SHA-256 of the whole file. Layout (docs/multi_replica.md#unit-files):

    MAGIC | u32 little-endian header length | header (UTF-8 JSON) | payload | SHA-256 of everything before it

The payload is each array's blocks back to back, in header order; an array is one cache (named as the engine
names it) and lists which of the sequence's blocks it holds, since a sliding-window cache keeps only its last few.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

MAGIC = b"DIKVU001"
CHECKSUM_BYTES = 32
_LENGTH = struct.Struct("<I")
PREAMBLE_BYTES = len(MAGIC) + _LENGTH.size


class UnitError(ValueError):
    """A file that is not a complete, intact unit of the expected model and prefix."""


@dataclass(frozen=True)
class Array:
    name: str
    block_bytes: int
    blocks: tuple[int, ...]  # the sequence's block indices this array holds, ascending

    @property
    def nbytes(self) -> int:
        return self.block_bytes * len(self.blocks)


@dataclass(frozen=True)
class UnitHeader:
    model: str  # the store's model tag: units of another model or cache layout are foreign
    prefix: str  # hex digest of the token prefix (and images) the unit resumes
    anchor: str  # the lookup anchor the unit is filed under (store.py), so a sweep can drop its marker
    num_tokens: int
    retention_s: float  # the unit expires this long after it was last written or served
    arrays: tuple[Array, ...]

    def to_json(self) -> bytes:
        body = {"model": self.model, "prefix": self.prefix, "anchor": self.anchor, "num_tokens": self.num_tokens,
                "retention_s": self.retention_s,
                "arrays": [{"name": a.name, "block_bytes": a.block_bytes, "blocks": list(a.blocks)}
                           for a in self.arrays]}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "UnitHeader":
        try:
            body = json.loads(raw)
            arrays = tuple(Array(str(a["name"]), int(a["block_bytes"]), tuple(int(b) for b in a["blocks"]))
                           for a in body["arrays"])
            return cls(str(body["model"]), str(body["prefix"]), str(body["anchor"]), int(body["num_tokens"]),
                       float(body["retention_s"]), arrays)
        except (ValueError, KeyError, TypeError) as error:
            raise UnitError(f"unreadable unit header: {error}") from None


def encode(header: UnitHeader, payloads: list[bytes]) -> bytes:
    if len(payloads) != len(header.arrays):
        raise ValueError(f"{len(payloads)} payloads for {len(header.arrays)} arrays")
    for array, payload in zip(header.arrays, payloads):
        if len(payload) != array.nbytes:
            raise ValueError(f"array {array.name}: {len(payload)} bytes, expected {array.nbytes}")
    raw = header.to_json()
    body = b"".join([MAGIC, _LENGTH.pack(len(raw)), raw, *payloads])
    return body + hashlib.sha256(body).digest()


def read_header(preamble_and_header: bytes) -> tuple[UnitHeader, int]:
    """The header from a file's first bytes, and the offset its payload starts at; enough to judge expiry
    without reading the payload. Raises UnitError when the bytes given are too few or not a unit."""
    if preamble_and_header[:len(MAGIC)] != MAGIC:
        raise UnitError("not a unit file (bad magic)")
    if len(preamble_and_header) < PREAMBLE_BYTES:
        raise UnitError("truncated unit (no header length)")
    (length,) = _LENGTH.unpack_from(preamble_and_header, len(MAGIC))
    end = PREAMBLE_BYTES + length
    if len(preamble_and_header) < end:
        raise UnitError("truncated unit header")
    return UnitHeader.from_json(preamble_and_header[PREAMBLE_BYTES:end]), end


def decode(data: bytes, model: str, prefix: str) -> tuple[UnitHeader, dict[str, memoryview]]:
    """Check a whole unit and split its payload per array. Raises UnitError for a truncated or corrupted file,
    another model's unit, or a unit of another prefix."""
    if len(data) < PREAMBLE_BYTES + CHECKSUM_BYTES:
        raise UnitError(f"truncated unit ({len(data)} bytes)")
    body, checksum = memoryview(data)[:-CHECKSUM_BYTES], data[-CHECKSUM_BYTES:]
    if hashlib.sha256(body).digest() != checksum:
        raise UnitError("checksum mismatch (truncated or corrupted unit)")
    header, at = read_header(bytes(body[:PREAMBLE_BYTES + _LENGTH.unpack_from(data, len(MAGIC))[0]]))
    if header.model != model:
        raise UnitError(f"unit of another model or cache layout ({header.model}, expected {model})")
    if header.prefix != prefix:
        raise UnitError("unit of another prefix")
    arrays = {}
    for array in header.arrays:
        arrays[array.name] = body[at: at + array.nbytes]
        at += array.nbytes
    if at != len(body):
        raise UnitError(f"payload of {len(body) - PREAMBLE_BYTES} bytes does not match its header")
    return header, arrays
