"""A retained prefix cache on a directory every replica mounts (3FS, NFS or CephFS in production).

A unit (unit.py) resumes one sequence at one token boundary. It is named by the digest of that prefix, so any
replica that renders the same prompt finds what another stored, and it is reusable only at exactly that
boundary: a sliding-window cache holds the last window of its boundary and nothing before it. To find the longest
stored boundary inside a new prompt without knowing the boundaries, each unit also leaves an empty marker file
under an anchor, the digest of its prefix cut down to a multiple of ``ANCHOR_TOKENS``: a lookup walks the
prompt's anchors from the longest down and lists only those folders.

Layout under ``root/<model tag>/``:
  ``units/<2 hex>/<prefix digest>.unit``   the units, written to a hidden temporary name and renamed into
                                           place, so a reader sees a whole unit or none;
  ``anchors/<anchor digest>/<tokens>-<prefix digest>``   the markers.

A unit expires ``retention_s`` (from its header) after its file was last written or served: serving it touches
its modification time, which is also what the capacity limit evicts by (least recently used first). Expired units
are never served; ``sweep`` deletes them. Why a unit is trusted or refused is in docs/multi_replica.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from .unit import PREAMBLE_BYTES, Array, UnitError, UnitHeader, decode, encode, read_header

logger = logging.getLogger("deepinfer.kvstore")

ANCHOR_TOKENS = 256
STALE_TEMPORARY_S = 3600.0
VERIFIED_ENTRIES = 4096  # a temporary file this old belongs to a writer that died mid-write
AGENT_RETENTION_S = 3 * 86400.0
CHAT_RETENTION_S = 7 * 86400.0


@dataclass(frozen=True)
class Retention:
    """How long units live: agent traffic (tool use) and chat have their own defaults; ``fixed`` (a server
    flag) replaces both, and a request's own value replaces all three."""

    agent_s: float = AGENT_RETENTION_S
    chat_s: float = CHAT_RETENTION_S
    fixed_s: float | None = None

    def seconds(self, agent: bool, requested_s: float | None = None) -> float:
        if requested_s is not None:
            return requested_s
        if self.fixed_s is not None:
            return self.fixed_s
        return self.agent_s if agent else self.chat_s


class PrefixKey:
    """Digests of one sequence's prefixes. Images enter by their content identifier at their placeholder
    offset, so two prompts whose image placeholders are equal token for token but show different images never
    share a unit; a cache salt (per tenant) and the model tag start the chain."""

    def __init__(self, model: str, tokens: Sequence[int], images: Sequence[tuple[int, str]] = (), salt: str = ""):
        self._tokens = tokens
        self._images = sorted(images)
        self._chain = [hashlib.sha256(b"deepinfer-prefix\0" + model.encode() + b"\0" + salt.encode()).digest()]

    def __len__(self) -> int:
        return len(self._tokens)

    def _span(self, start: int, end: int) -> bytes:
        images = "".join(f"{offset}:{identifier};" for offset, identifier in self._images if start <= offset < end)
        return array("q", self._tokens[start:end]).tobytes() + b"|" + images.encode()

    def _anchor_bytes(self, chunk: int) -> bytes:
        if chunk * ANCHOR_TOKENS > len(self._tokens):
            raise ValueError(f"anchor {chunk} lies past the sequence ({len(self._tokens)} tokens)")
        while len(self._chain) <= chunk:
            k = len(self._chain) - 1
            self._chain.append(hashlib.sha256(self._chain[k] + self._span(k * ANCHOR_TOKENS,
                                                                           (k + 1) * ANCHOR_TOKENS)).digest())
        return self._chain[chunk]

    def anchor(self, num_tokens: int) -> str:
        """The anchor a prefix of ``num_tokens`` tokens is filed under."""
        return self._anchor_bytes(num_tokens // ANCHOR_TOKENS).hex()

    def digest(self, num_tokens: int) -> str:
        chunk = num_tokens // ANCHOR_TOKENS
        return hashlib.sha256(self._anchor_bytes(chunk) + self._span(chunk * ANCHOR_TOKENS, num_tokens)
                              + b"#%d" % num_tokens).hexdigest()


@dataclass
class Counters:
    """What the store did since the last ``take``. Hits and misses are counted by the engine adapter, which
    knows whether a found unit was used; the rest here."""

    hits: int = 0
    hit_tokens: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    units_written: int = 0
    evictions: int = 0
    expiries: int = 0
    invalid: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def take(self) -> dict[str, int]:
        with self._lock:
            names = [f.name for f in fields(self) if not f.name.startswith("_")]
            taken = {name: getattr(self, name) for name in names}
            for name in names:
                setattr(self, name, 0)
        return taken


@dataclass(frozen=True)
class Found:
    prefix: str
    num_tokens: int


@dataclass(frozen=True)
class SweepResult:
    expired: int
    evicted: int
    invalid: int
    removed_bytes: int
    kept_bytes: int


class PrefixStore:
    def __init__(self, root: str | Path, model: str, log: logging.Logger = logger):
        """``log`` takes the warnings about units refused or removed; an engine passes a logger its server
        log shows."""
        if not model or "/" in model or model.startswith("."):
            raise ValueError(f"model tag {model!r} must be a plain file name")
        self.model = model
        self.dir = Path(root) / model
        self.counters = Counters()
        self.log = log
        self._verified: dict[Path, tuple[int, int, int]] = {}  # unit -> (inode, size, mtime) it was checked at

    def unit_path(self, prefix: str) -> Path:
        return self.dir / "units" / prefix[:2] / f"{prefix}.unit"

    def _marker(self, anchor: str, num_tokens: int, prefix: str) -> Path:
        return self.dir / "anchors" / anchor / f"{num_tokens}-{prefix}"

    def find(self, key: PrefixKey, longest: int, shortest: int = 0) -> Found | None:
        """The longest intact, unexpired unit of a prefix of ``key`` with shortest < tokens <= longest."""
        longest = min(longest, len(key))
        for chunk in range(longest // ANCHOR_TOKENS, shortest // ANCHOR_TOKENS - 1, -1):
            folder = self.dir / "anchors" / key.anchor(chunk * ANCHOR_TOKENS)
            try:
                names = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            candidates = []
            for name in names:
                tokens, _, prefix = name.partition("-")
                if tokens.isdigit() and shortest < int(tokens) <= longest:
                    candidates.append((int(tokens), prefix))
            for tokens, prefix in sorted(candidates, reverse=True):
                if key.digest(tokens) == prefix and self._servable(prefix):
                    return Found(prefix, tokens)
        return None

    def _servable(self, prefix: str) -> bool:
        path = self.unit_path(prefix)
        try:
            stat = path.stat()
            header = _read_header(path)
            if _expired(header, stat, time.time()):
                return False
            seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if self._verified.get(path) != seen:
                data = path.read_bytes()
                decode(data, self.model, prefix)
                self.counters.add(bytes_read=len(data))
                self._remember_verified(path, seen)
            return True
        except FileNotFoundError:
            return False
        except (UnitError, OSError) as error:
            self.log.warning("kv store: %s is not served: %s", path, error)
            self.counters.add(invalid=1)
            self._verified.pop(path, None)
            return False

    def _remember_verified(self, path: Path, seen: tuple[int, int, int]) -> None:
        """A shared prefix (one system prompt behind many conversations) is found again and again: its check is
        remembered per file version, for the most recent ``VERIFIED_ENTRIES`` units."""
        self._verified.pop(path, None)
        self._verified[path] = seen
        if len(self._verified) > VERIFIED_ENTRIES:
            del self._verified[next(iter(self._verified))]

    def read(self, prefix: str) -> tuple[UnitHeader, dict[str, memoryview]]:
        """A unit's arrays, checked again: the file may have changed since ``find`` judged it."""
        path = self.unit_path(prefix)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise UnitError(f"{path}: {error}") from None
        self.counters.add(bytes_read=len(data))
        return decode(data, self.model, prefix)

    def touch(self, prefix: str) -> None:
        """Mark a unit used now: its retention and its place in the eviction order restart."""
        path = self.unit_path(prefix)
        try:
            os.utime(path)
            stat = path.stat()
        except OSError:
            return
        if path in self._verified:
            self._remember_verified(path, (stat.st_ino, stat.st_size, stat.st_mtime_ns))

    def holds(self, prefix: str) -> bool:
        """Whether an unexpired unit of this prefix is on file (header only: saving again would write the same
        bytes, so a caller that gets True touches it instead)."""
        path = self.unit_path(prefix)
        try:
            stat = path.stat()
            header = _read_header(path)
        except (OSError, UnitError):
            return False
        return header.model == self.model and not _expired(header, stat, time.time())

    def write(self, prefix: str, anchor: str, num_tokens: int, retention_s: float, arrays: Sequence[Array],
              payloads: Sequence[bytes]) -> int:
        """Store a unit atomically (temporary file, fsync, rename); returns the bytes written. Two writers of
        one prefix each rename a whole unit into place, so one of them is what stays."""
        header = UnitHeader(self.model, prefix, anchor, num_tokens, float(retention_s), tuple(arrays))
        data = encode(header, list(payloads))
        path = self.unit_path(prefix)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.parent / f".{prefix}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with temporary.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        marker = self._marker(anchor, num_tokens, prefix)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        self.counters.add(bytes_written=len(data), units_written=1)
        return len(data)

    def sweep(self, capacity_bytes: int | None = None, now: float | None = None) -> SweepResult:
        """Delete expired units, units whose header cannot be read, temporary files of dead writers and markers
        of missing units; then, over ``capacity_bytes``, the least recently used units."""
        now = time.time() if now is None else now
        expired = invalid = removed = 0
        live = []
        for path in sorted((self.dir / "units").glob("*/*")):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            if path.name.startswith("."):
                if path.name.endswith(".tmp") and stat.st_mtime < now - STALE_TEMPORARY_S:
                    removed += _remove_if_unchanged(path, stat)
                continue
            try:
                header = _read_header(path)
            except (OSError, UnitError) as error:
                self.log.warning("kv store: removing unreadable unit %s: %s", path, error)
                removed += _remove_if_unchanged(path, stat)
                invalid += 1
                continue
            if _expired(header, stat, now):
                removed += _remove_if_unchanged(path, stat)
                expired += 1
            else:
                live.append((stat.st_mtime, path, stat))
        kept = sum(stat.st_size for _, _, stat in live)
        evicted = 0
        if capacity_bytes is not None:
            for _, path, stat in sorted(live, key=lambda entry: entry[0]):
                if kept <= capacity_bytes:
                    break
                freed = _remove_if_unchanged(path, stat)
                if freed:
                    kept -= freed
                    removed += freed
                    evicted += 1
        for marker in (self.dir / "anchors").glob("*/*"):
            tokens, _, prefix = marker.name.partition("-")
            if not self.unit_path(prefix).exists():
                marker.unlink(missing_ok=True)
        self.counters.add(expiries=expired, evictions=evicted, invalid=invalid)
        return SweepResult(expired, evicted, invalid, removed, kept)


def _expired(header: UnitHeader, stat: os.stat_result, now: float) -> bool:
    """Retention runs from the file's last write or last hit (``touch``)."""
    return now > stat.st_mtime + header.retention_s


def _read_header(path: Path) -> UnitHeader:
    """A unit's header without its payload: enough to judge expiry."""
    with path.open("rb") as f:
        preamble = f.read(PREAMBLE_BYTES)
        length = int.from_bytes(preamble[len(preamble) - 4:], "little") if len(preamble) == PREAMBLE_BYTES else 0
        header, _ = read_header(preamble + f.read(length))
    return header


def _remove_if_unchanged(path: Path, seen: os.stat_result) -> int:
    """Unlink a file unless a writer replaced or a reader touched it since ``seen``; returns bytes freed."""
    try:
        now = path.stat()
        if (now.st_ino, now.st_mtime_ns) != (seen.st_ino, seen.st_mtime_ns):
            return 0
        path.unlink()
    except FileNotFoundError:
        return 0
    return now.st_size
