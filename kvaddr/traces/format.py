"""The kvaddr trace format: one serving step per line of JSON (docs/trace-format.md).

A trace is a JSON Lines file (optionally gzip-compressed): an optional header
line, then one line per engine step::

    {"kvaddr_trace": 1, "block_sizes": [64, 64], "model": "deepseek-v3.2"}
    {"step": 0, "seq_lens_decoder": [0], "seq_lens_this_time": [300], "seq_lens_encoder": [300],
     "block_tables": [[7, 3, 12, 40, 41]]}
    {"step": 1, "seq_lens_decoder": [300], "seq_lens_this_time": [1], "seq_lens_encoder": [0],
     "block_tables": [[7, 3, 12, 40, 41]]}

Per step and request: ``seq_lens_decoder`` (tokens already in the KV cache),
``seq_lens_this_time`` (tokens run this step), optionally
``seq_lens_encoder`` (prefill tokens this step; zeros when absent), and the
request's block list in ``block_tables`` (one list of block ids per request,
shared by every cache; a padded block-table row with trailing -1 is the same
thing) or ``block_tables_per_cache`` (one such table per cache). Other keys
are ignored.

Every line stands alone, so a bad line costs only itself: :class:`TraceReader`
yields a :class:`BadLine` with the line number and the reason and carries on.
A file that cannot be read to its end (a truncated or corrupt gzip stream)
yields every line it could read, then a :class:`DamagedTrace` (a BadLine)
naming the line where reading stopped. A file that is not a trace at all
(empty, binary, another JSON document: none of its first :data:`SNIFF_LINES`
non-blank lines is a header or a step) raises :class:`NotATraceError`.
The reader streams: it holds one line at a time, whatever the trace's length.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
import zlib
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from kvaddr.constants import INT32_MAX, MAX_TABLE_ENTRIES, MAX_TOKENS_PER_STEP
from kvaddr.errors import KvaddrError, NotATraceError, TraceError

if TYPE_CHECKING:  # pragma: no cover
    from kvaddr.measure.workload import Batch

#: The format version this module reads and writes.
FORMAT_VERSION = 1
#: The key that marks a header line (its value is the format version).
HEADER_KEY = "kvaddr_trace"
#: Limits that keep one step within memory; a larger step is a bad line.
MAX_REQUESTS = 1 << 20
MAX_TOKENS = MAX_TOKENS_PER_STEP

STEP_KEYS = ("seq_lens_decoder", "seq_lens_this_time", "seq_lens_encoder", "block_tables", "block_tables_per_cache")
#: Non-blank lines the reader looks at for a header or a step before it calls a file "not a kvaddr trace".
SNIFF_LINES = 8
#: Bytes at the start of the (decompressed) file that must look like text.
SNIFF_BYTES = 4096


@dataclass(frozen=True)
class TraceHeader:
    """The optional first line of a trace.

    Attributes
    ----------
    version : int
    block_sizes : tuple of int or None
        B of each cache.
    model : str or None
        The model preset the trace was made for.
    meta : dict
        The whole line (the generator's settings, for instance).
    """

    version: int
    block_sizes: tuple | None
    model: str | None
    meta: dict


@dataclass
class RaggedTable:
    """One block table as per-request lists: ``lengths[b]`` ids of ``flat`` for request b."""

    lengths: np.ndarray
    flat: np.ndarray

    @property
    def width(self) -> int:
        return int(self.lengths.max()) if self.lengths.size else 0

    def padded(self, rows: int, width: int) -> np.ndarray:
        """An int32 ``[rows, width]`` table, -1 past each request's list and in the extra rows."""
        out = np.full((rows, width), -1, dtype=np.int32)
        n = self.lengths.shape[0]
        if self.flat.size:
            mask = np.arange(width)[None, :] < self.lengths[:, None]
            out[:n][mask] = self.flat
        return out

    def __eq__(self, other):
        return (
            isinstance(other, RaggedTable)
            and np.array_equal(self.lengths, other.lengths)
            and np.array_equal(self.flat, other.flat)
        )


@dataclass
class TraceStep:
    """One good step line.

    Attributes
    ----------
    line : int
        1-based line number in the file.
    index : int
        0-based index among the trace's step lines (good or bad).
    step : int or None
        The line's own ``step`` field.
    seq_lens_decoder, seq_lens_this_time, seq_lens_encoder : int32 [bsz]
    tables : list of RaggedTable
        Distinct block tables.
    cache_table : tuple of int or None
        Which of ``tables`` each cache uses; None: ``tables[0]`` serves every cache.
    """

    line: int
    index: int
    step: int | None
    seq_lens_decoder: np.ndarray
    seq_lens_this_time: np.ndarray
    seq_lens_encoder: np.ndarray
    tables: list
    cache_table: tuple | None = None

    @property
    def bsz(self) -> int:
        return int(self.seq_lens_decoder.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.seq_lens_this_time.sum(dtype=np.int64))

    @property
    def active(self) -> int:
        """Requests that run at least one token (idle slots excluded)."""
        return int(np.count_nonzero(self.seq_lens_this_time))

    @property
    def prefill_requests(self) -> int:
        return int(np.count_nonzero(self.seq_lens_encoder))

    @property
    def width(self) -> int:
        return max((t.width for t in self.tables), default=0)

    def tables_for(self, num_caches: int) -> list:
        """Index into ``tables`` for each of ``num_caches`` caches; ValueError when they do not match."""
        if self.cache_table is None:
            return [0] * num_caches
        if len(self.cache_table) != num_caches:
            raise ValueError(f"block_tables_per_cache holds {len(self.cache_table)} tables for {num_caches} caches")
        return list(self.cache_table)


@dataclass(frozen=True)
class BadLine:
    """A line that is not a valid step: its number and why."""

    line: int
    reason: str


#: How a :class:`DamagedTrace`'s reason starts.
DAMAGED = "reading stopped here"


@dataclass(frozen=True)
class DamagedTrace(BadLine):
    """The file could not be read past line ``line - 1`` (a truncated or corrupt gzip stream, a read error).

    The reader yields it last, after every line it could read; ``line`` is the
    first line it could not read.
    """


# ----------------------------------------------------------------------------- parsing


class _Bad(KvaddrError, ValueError):
    pass


def _lengths(obj: dict, key: str, bsz: int | None, required: bool = True):
    if key not in obj:
        if required:
            raise _Bad(f"missing {key!r}")
        return None
    value = obj[key]
    if not isinstance(value, list):
        raise _Bad(f"{key} must be a list of integers, got {type(value).__name__}")
    if bsz is not None and len(value) != bsz:
        raise _Bad(f"{key} has {len(value)} entries, seq_lens_decoder has {bsz}")
    arr = _int_array(value, key)
    if arr.size:
        lo = int(arr.min())
        if lo < 0:
            i = int(np.argmin(arr))
            raise _Bad(f"{key}[{i}] = {lo} is negative")
        if int(arr.max()) > INT32_MAX:
            raise _Bad(f"{key}[{int(np.argmax(arr))}] = {int(arr.max())} is beyond int32")
    return arr.astype(np.int32)


def _int_array(values: list, what: str) -> np.ndarray:
    if not values:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.array(values)
    except (ValueError, OverflowError, TypeError):
        arr = None
    if arr is None or arr.dtype.kind not in "iu" or arr.ndim != 1:
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise _Bad(f"{what}[{i}] must be an integer, got {json.dumps(v)[:40]}")
            if not -(1 << 63) <= v < (1 << 63):
                raise _Bad(f"{what}[{i}] = {v} is out of range")
        raise _Bad(f"{what} must be a list of integers")
    return arr.astype(np.int64, copy=False)


def _table(value, key: str, bsz: int) -> RaggedTable:
    if not isinstance(value, list):
        raise _Bad(f"{key} must be a list with one list of block ids per request, got {type(value).__name__}")
    if len(value) != bsz:
        raise _Bad(f"{key} has {len(value)} rows, seq_lens_decoder has {bsz} requests")
    for b, row in enumerate(value):
        if not isinstance(row, list):
            raise _Bad(f"{key}[{b}] must be a list of block ids, got {json.dumps(row)[:40]}")
    lengths = np.fromiter((len(r) for r in value), dtype=np.int64, count=bsz)
    total = int(lengths.sum())
    if total > MAX_TABLE_ENTRIES:
        raise _Bad(f"{key} holds {total} block ids, more than the {MAX_TABLE_ENTRIES} kvaddr replays per step")
    flat_list = list(chain.from_iterable(value))
    try:
        flat = _int_array(flat_list, "block ids")
    except _Bad:
        for b, row in enumerate(value):
            try:
                _int_array(row, f"{key}[{b}]")
            except _Bad as exc:
                raise _Bad(str(exc)) from None
        raise
    if flat.size and (int(flat.min()) < -(1 << 31) or int(flat.max()) > INT32_MAX):
        bad = int(np.flatnonzero((flat < -(1 << 31)) | (flat > INT32_MAX))[0])
        row = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
        raise _Bad(f"{key}[{row}] holds {int(flat[bad])}, beyond int32")
    return RaggedTable(lengths, flat.astype(np.int32))


def parse_step(obj, line: int, index: int) -> TraceStep:
    """Check one decoded step line and turn it into arrays.

    Raises
    ------
    ValueError
        With the reason the line is not a valid step.
    """
    if not isinstance(obj, dict):
        raise _Bad(f"a step line must be a JSON object, got {type(obj).__name__}")
    if HEADER_KEY in obj:
        raise _Bad("a header line may only be the first line")
    dec = _lengths(obj, "seq_lens_decoder", None)
    bsz = int(dec.shape[0])
    if bsz > MAX_REQUESTS:
        raise _Bad(f"{bsz} requests in one step, more than the {MAX_REQUESTS} kvaddr replays")
    q = _lengths(obj, "seq_lens_this_time", bsz)
    enc = _lengths(obj, "seq_lens_encoder", bsz, required=False)
    if enc is None:
        enc = np.zeros(bsz, dtype=np.int32)
    tokens = int(q.sum(dtype=np.int64))
    if tokens > MAX_TOKENS:
        raise _Bad(f"{tokens} tokens in one step, more than the {MAX_TOKENS} kvaddr replays")
    ends = dec.astype(np.int64) + q
    if bsz and int(ends.max()) > INT32_MAX:
        raise _Bad(f"seq_lens_decoder + seq_lens_this_time of request {int(np.argmax(ends))} is beyond int32")
    shared, per_cache = obj.get("block_tables"), obj.get("block_tables_per_cache")
    if (shared is None) == (per_cache is None):
        raise _Bad("give exactly one of 'block_tables' (shared by every cache) and 'block_tables_per_cache'")
    step_no = obj.get("step")
    if step_no is not None and (isinstance(step_no, bool) or not isinstance(step_no, int)):
        raise _Bad(f"step must be an integer, got {json.dumps(step_no)[:40]}")
    if shared is not None:
        return TraceStep(line, index, step_no, dec, q, enc, [_table(shared, "block_tables", bsz)], None)
    if not isinstance(per_cache, list) or not per_cache:
        raise _Bad("block_tables_per_cache must be a non-empty list with one block table per cache")
    tables, which = [], []
    for g, t in enumerate(per_cache):
        rt = _table(t, f"block_tables_per_cache[{g}]", bsz)
        for i, seen in enumerate(tables):  # caches that share a table keep one copy
            if seen == rt:
                which.append(i)
                break
        else:
            which.append(len(tables))
            tables.append(rt)
    return TraceStep(line, index, step_no, dec, q, enc, tables, tuple(which))


def parse_header(obj: dict, line: int = 1) -> TraceHeader:
    """Check a header line; raise :class:`TraceError` when kvaddr cannot use it."""
    version = obj.get(HEADER_KEY)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TraceError(f"line {line}: {HEADER_KEY} must be the format version (an integer >= 1), got {version!r}")
    if version > FORMAT_VERSION:
        raise TraceError(
            f"line {line}: trace format version {version} is newer than this kvaddr reads "
            f"({FORMAT_VERSION}); upgrade kvaddr"
        )
    sizes = obj.get("block_sizes")
    if sizes is not None:
        if (
            not isinstance(sizes, list)
            or not sizes
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)
        ):
            raise TraceError(f"line {line}: block_sizes must be a list of integers >= 1 (one per cache), got {sizes!r}")
        sizes = tuple(sizes)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise TraceError(f"line {line}: model must be a string, got {model!r}")
    return TraceHeader(version, sizes, model, dict(obj))


# ----------------------------------------------------------------------------- reading


class _CountingReader(io.RawIOBase):
    """Counts the (compressed) bytes read from a binary file, for progress."""

    def __init__(self, raw):
        self.raw, self.count = raw, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = self.raw.readinto(b)
        self.count += n or 0
        return n

    def close(self):
        try:
            self.raw.close()
        finally:
            super().close()


class TraceReader:
    """Stream a trace: the header, then a :class:`TraceStep` or :class:`BadLine` per line.

    Parameters
    ----------
    path : str
        A file (gzip-compressed when its first bytes say so) or ``"-"`` for stdin.

    Attributes
    ----------
    header : TraceHeader or None
    size : int or None
        Bytes in the file (None for stdin).

    The reader holds one line at a time: memory does not grow with the trace.
    Blank lines are skipped. Use it as a context manager, or call
    :meth:`close`.

    Raises
    ------
    TraceError
        The file cannot be opened, its header line is unusable, or it cannot be
        read up to its first line.
    NotATraceError
        The file is not a kvaddr trace (a :class:`TraceError`).

    Damage met later (a truncated or corrupt gzip stream) does not raise: the
    lines read so far are yielded, then a :class:`DamagedTrace`.
    """

    def __init__(self, path: str):
        self.path = path
        self.header: TraceHeader | None = None
        self.size = None
        self._pending = []
        self._line = 0
        self._index = 0
        self._damage = None
        self._gzip = False
        try:
            self._closers = []
            if path == "-":
                self._counter = None
                self._fh = sys.stdin.buffer
                if not hasattr(self._fh, "peek"):
                    self._fh = io.BufferedReader(self._fh)
                if self._fh.peek(2)[:2] == b"\x1f\x8b":
                    self._fh = gzip.GzipFile(fileobj=self._fh, mode="rb")
                    self._gzip = True
            else:
                self.size = os.path.getsize(path)
                f = open(path, "rb")  # noqa: SIM115  (closed by the reader)
                magic = f.peek(2)[:2]
                self._counter = _CountingReader(f)
                buffered = io.BufferedReader(self._counter, buffer_size=1 << 20)
                self._closers.append(buffered)
                self._fh = buffered
                if magic == b"\x1f\x8b":
                    self._fh = gzip.GzipFile(fileobj=buffered, mode="rb")
                    self._closers.insert(0, self._fh)
                    self._gzip = True
        except OSError as exc:
            raise TraceError(f"cannot open the trace {path!r}: {exc.strerror or exc}") from None
        self._source = self._lines()
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _not_a_trace(self, why: str) -> NotATraceError:
        return NotATraceError(f"not a kvaddr trace: {self.path}: {why}")

    def _read_header(self) -> None:
        """Read the header, or the first lines until one looks like a step; else the file is not a trace.

        A trace's first non-blank line is a header or a step; a damaged line or two may come first,
        so up to :data:`SNIFF_LINES` non-blank lines are looked at (and kept for :meth:`__iter__`).
        """
        try:
            head = self._fh.peek(SNIFF_BYTES)[:SNIFF_BYTES] if hasattr(self._fh, "peek") else b""
        except (OSError, EOFError):
            head = b""  # a damaged stream: reported where reading stops
        if b"\x00" in head:
            raise self._not_a_trace(f"binary data (a NUL byte in its first {len(head)} bytes)")
        for raw in self._source:
            if not raw.strip():
                continue
            if b"\x00" in raw:
                raise self._not_a_trace(f"binary data (a NUL byte on line {self._line})")
            try:
                obj = json.loads(raw)
            except ValueError:  # UnicodeDecodeError included
                obj = None
            if not self._pending and isinstance(obj, dict) and HEADER_KEY in obj:
                self.header = parse_header(obj, self._line)
                return
            self._pending.append((self._line, raw, obj))
            if isinstance(obj, dict) and any(k in obj for k in (HEADER_KEY, *STEP_KEYS)):
                return
            if len(self._pending) >= SNIFF_LINES:
                break
        if self._damage is not None and not self._pending:
            line, exc = self._damage
            raise TraceError(f"cannot read the trace {self.path!r}: {exc} (before line {line}, its first)")
        if not self._pending:
            raise self._not_a_trace("the file is empty" if self._line == 0 else "it holds only blank lines")
        line, raw, obj = self._pending[0]
        why = self._parse(line, raw, obj).reason if obj is None else "a JSON value with none of a step's keys"
        raise self._not_a_trace(
            f"none of its first {len(self._pending)} non-blank line(s) is a trace step or header line "
            f"(line {line}: {why}); see docs/trace-format.md"
        )

    def _lines(self):
        try:
            for raw in self._fh:
                self._line += 1
                yield raw
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            self._damage = (self._line + 1, exc)

    @property
    def bytes_read(self) -> int:
        """Bytes of the file consumed so far (compressed bytes for a gzip file)."""
        return self._counter.count if self._counter is not None else 0

    def _parse(self, line: int, raw: bytes, obj=None):
        index = self._index
        self._index += 1
        if obj is None:
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError as exc:
                return BadLine(line, f"not UTF-8 text (byte {exc.start})")
            except ValueError as exc:
                msg = getattr(exc, "msg", None)
                col = getattr(exc, "colno", None)
                return BadLine(line, f"not JSON: {msg} at column {col}" if msg else f"not JSON: {exc}")
        try:
            return parse_step(obj, line, index)
        except ValueError as exc:
            return BadLine(line, str(exc))

    def __iter__(self):
        while self._pending:
            line, raw, obj = self._pending.pop(0)
            yield self._parse(line, raw, obj)
        for raw in self._source:
            if not raw.strip():
                continue
            yield self._parse(self._line, raw)
        if self._damage is not None:
            line, exc = self._damage
            self._damage = None
            what = "the gzip stream ends early or is corrupt" if self._gzip else "the file cannot be read further"
            yield DamagedTrace(line, f"{DAMAGED}: {what} ({exc})")

    def close(self) -> None:
        for c in self._closers:
            c.close()
        self._closers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ----------------------------------------------------------------------------- writing


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


class TraceWriter:
    """Write a trace: the header line, then one line per :meth:`write_step`.

    Parameters
    ----------
    path : str
        A file (gzip-compressed, reproducibly, when it ends in ``.gz``) or
        ``"-"`` for stdout.
    header : dict
        Extra header fields (``block_sizes`` is required; ``model`` and
        ``generator`` are customary). ``kvaddr_trace`` is set here.
    """

    def __init__(self, path: str, header: dict):
        self.path = path
        self.steps = 0
        if path == "-":
            self._fh, self._close = sys.stdout, False
        else:
            if path.endswith(".gz"):
                raw = open(path, "wb")  # noqa: SIM115  (closed by close())
                gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1)
                self._raw = raw
                self._fh = io.TextIOWrapper(gz, encoding="utf-8", newline="\n")
            else:
                self._raw = None
                self._fh = open(path, "w", encoding="utf-8", newline="\n")  # noqa: SIM115  (closed by close())
            self._close = True
        self._fh.write(_dumps({HEADER_KEY: FORMAT_VERSION, **header}) + "\n")

    def write_step(self, seq_lens_decoder, seq_lens_this_time, seq_lens_encoder, block_tables, step=None) -> None:
        """One step: three lists of ints (one per request) and one block list per request.

        ``block_tables`` may also be a dict ``{"block_tables_per_cache": [...]}``
        for caches with tables of their own.
        """
        obj = {
            "step": self.steps if step is None else step,
            "seq_lens_decoder": seq_lens_decoder,
            "seq_lens_this_time": seq_lens_this_time,
            "seq_lens_encoder": seq_lens_encoder,
        }
        if isinstance(block_tables, dict):
            obj.update(block_tables)
        else:
            obj["block_tables"] = block_tables
        self._fh.write(_dumps(obj) + "\n")
        self.steps += 1

    def close(self) -> None:
        if self._close:
            self._fh.close()
            if getattr(self, "_raw", None) is not None:
                self._raw.close()
        else:
            self._fh.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def padded_inputs(step: TraceStep, rows: int, capacity: int, width: int, block_sizes) -> Batch:
    """A step as the strategies take it: padded to ``rows`` requests and ``width`` blocks.

    The extra rows are idle requests (every length 0, table rows -1); caches
    that share a table share one array.

    Returns
    -------
    kvaddr.measure.workload.Batch
    """
    from kvaddr.measure.workload import Batch

    bsz = step.bsz
    if rows < bsz or width < step.width:
        raise ValueError(f"cannot pad a step of {bsz} requests and {step.width} blocks to {rows} x {width}")

    def pad(a):
        out = np.zeros(rows, dtype=np.int32)
        out[:bsz] = a
        return out

    arrays = [t.padded(rows, width) for t in step.tables]
    which = step.tables_for(len(block_sizes))
    return Batch(
        seq_lens_decoder=pad(step.seq_lens_decoder),
        seq_lens_this_time=pad(step.seq_lens_this_time),
        seq_lens_encoder=pad(step.seq_lens_encoder),
        block_tables=[arrays[i] for i in which],
        block_sizes=tuple(block_sizes),
        capacity=capacity,
        seed=[],
    )


__all__ = [
    "DAMAGED",
    "FORMAT_VERSION",
    "HEADER_KEY",
    "BadLine",
    "DamagedTrace",
    "NotATraceError",
    "RaggedTable",
    "TraceError",
    "TraceHeader",
    "TraceReader",
    "TraceStep",
    "TraceWriter",
    "padded_inputs",
    "parse_header",
    "parse_step",
]
