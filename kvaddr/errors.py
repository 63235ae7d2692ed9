"""kvaddr's exceptions, all under :class:`KvaddrError`, and the device-side error bits of
the spec (docs/spec.md).

The exception tree (each class is defined here; the modules that raise one also
re-export it under its old home, e.g. ``kvaddr.traces.format.TraceError``)::

    KvaddrError                       base of everything kvaddr raises on purpose
    +-- KernelCompileError            kernels.cu failed to compile (the NVRTC log)
    +-- AddressingError               a step's inputs held bad values (check())
    +-- EnvironmentProblem            the machine cannot run what was asked (no GPU, no CuPy)
    |   +-- PlotUnavailable           matplotlib is not installed
    +-- CheckFailed                   a strategy disagreed with the reference
    +-- StrategyLimitExceeded (ValueError)  a step larger than a strategy can run (one-block: 1024 requests)
    +-- ProfileConfigError (ValueError)   a profile run's settings are invalid (names the option)
    +-- ProfileError                  a workload profile (TOML) cannot be found, parsed or applied
    +-- TraceError                    a trace cannot be read at all
    |   +-- NotATraceError            the file is not a kvaddr trace (empty, binary, another document)
    +-- AllocatorError (RuntimeError) the trace generator's block allocator was misused (a bug)
    +-- BaselineError                 a baseline file cannot be read or is not a baseline
    |   +-- BaselineMismatch          a baseline file holds runs of another machine
    |   +-- BaselineWriteError        a baseline file cannot be written
    +-- RevisionError                 a git revision to time against cannot be used (check --against)
    +-- SideFailed                    one side's profile process of an A/B run failed (its exit status)

No exception knows an exit status: the commands (:mod:`kvaddr.commands.common`)
map these types to exit codes.
"""

from __future__ import annotations

import numpy as np

#: Block index ``pos // B`` is beyond the table's width.
ERR_BLOCK_INDEX = 1
#: Negative (unallocated) block id for a real token.
ERR_NEGATIVE_BLOCK = 2
#: More tokens than the capacity C; the extra tokens are dropped.
ERR_CAPACITY = 4
#: Negative ``seq_lens_decoder`` or ``seq_lens_this_time``.
ERR_NEGATIVE_LENGTH = 8
#: More ``kv_indices`` entries than the capacity fixed at construction (attention
#: outputs, docs/attention.md); entries at index >= capacity are dropped.
ERR_KV_INDICES_CAPACITY = 16

ERROR_REASONS = {
    ERR_BLOCK_INDEX: "block index beyond the block table's width",
    ERR_NEGATIVE_BLOCK: "negative (unallocated) block id for a real token",
    ERR_CAPACITY: "more tokens than the capacity",
    ERR_NEGATIVE_LENGTH: "negative seq_lens_decoder or seq_lens_this_time",
    ERR_KV_INDICES_CAPACITY: "more kv_indices entries than their capacity",
}

#: Errors that concern one cache: their message names it.
CACHE_ERRORS = (ERR_BLOCK_INDEX, ERR_NEGATIVE_BLOCK, ERR_KV_INDICES_CAPACITY)

#: Key of "no error" in the first-bad-token record (all ones).
NO_ERROR_KEY = (1 << 64) - 1


_BIT_FIELD = 3  # log2(bit) in key bits 0..2: error bits up to 128
_CACHE_FIELD = 2  # cache in key bits 3..4: caches 0..3 (KV_MAX_CACHES = 4)
_REQUEST_SHIFT = _BIT_FIELD + _CACHE_FIELD  # request in key bits 5..31


def error_key(token: int, request: int, cache: int, bit: int) -> int:
    """Order errors the way the kernels do: by token, then request, cache, bit.

    ``key = token << 32 | request << 5 | cache << 3 | log2(bit)`` (cache 0..3 in a
    2-bit field, ``log2(bit)`` in a 3-bit field: bits up to 128); the smallest key
    over all errors of a step is its "first bad" record. kernels.cu's
    ``kv_err_key`` builds the same key.
    """
    cache, bit = int(cache), int(bit)
    if not 0 <= cache < (1 << _CACHE_FIELD):
        raise ValueError(f"cache must be in [0, {1 << _CACHE_FIELD}), got {cache}")
    if bit <= 0 or bit & (bit - 1) or bit.bit_length() > (1 << _BIT_FIELD):
        raise ValueError(f"bit must be one error bit (a power of two up to {1 << ((1 << _BIT_FIELD) - 1)}), got {bit}")
    return (int(token) << 32) | (int(request) << _REQUEST_SHIFT) | (cache << _BIT_FIELD) | (bit.bit_length() - 1)


def decode_error_key(key: int) -> tuple[int, int, int, int]:
    """Inverse of :func:`error_key`: ``(token, request, cache, bit)``."""
    key = int(key)
    return (
        key >> 32,
        (key >> _REQUEST_SHIFT) & ((1 << (32 - _REQUEST_SHIFT)) - 1),
        (key >> _BIT_FIELD) & ((1 << _CACHE_FIELD) - 1),
        1 << (key & ((1 << _BIT_FIELD) - 1)),
    )


# -- error records (docs/spec.md, "Errors") ---------------------------------------------
#
# A step's device errors live in records of two 64-bit words, (mask, first-bad key), one per
# warp. They are STICKY: a kernel writes only from a warp that found an error, merging into its
# record (atomicOr on the mask, atomicMin on the key), and no kernel clears them. The reader
# reduces every record (OR of the masks, smallest key) and then clears them: the planners'
# errors() / check() do both; whoever reads caller-owned records itself (a torch op's workspace,
# VllmStepBuffers.records, a VllmStepPlanner(error_records=...) array read directly) resets them
# with reset_error_records after reading.


def clean_error_records(count: int) -> np.ndarray:
    """``count`` cleared error records, uint64 ``[count, 2]``: mask 0, key :data:`NO_ERROR_KEY`."""
    rec = np.zeros((int(count), 2), dtype=np.uint64)
    rec[:, 1] = np.uint64(NO_ERROR_KEY)
    return rec


def reduce_error_records(records) -> tuple[int, int]:
    """``(error_mask, first_bad_key)`` of host error records: the OR of the masks and the
    smallest key (unsigned), ``(0, NO_ERROR_KEY)`` for none.

    Parameters
    ----------
    records : int64 or uint64 array, [R, 2] or flat [2 R] (NumPy, host)
        (mask, key) pairs; int64 words are read as their uint64 bit patterns.
    """
    rec = np.ascontiguousarray(records).reshape(-1)
    if rec.dtype != np.uint64:
        rec = rec.view(np.uint64)
    if rec.size == 0:
        return 0, NO_ERROR_KEY
    return int(np.bitwise_or.reduce(rec[0::2])), int(rec[1::2].min())


def reset_error_records(records) -> None:
    """Clear error records in place on the device (every mask 0, every key all ones), on the
    array library's current stream (torch's or CuPy's); no synchronisation.

    For caller-owned records that the caller reads itself: a torch op's workspace
    (:func:`kvaddr.torch.reset_workspace_errors` wraps this), ``VllmStepBuffers.records`` or the
    array given as ``VllmStepPlanner(error_records=...)`` when read directly.
    The records are sticky, so reset them after each read, or the next read also reports
    what this one did.

    Parameters
    ----------
    records : int64 or uint64 device array, [R, 2] or flat [2 R], contiguous
        A CuPy array or torch tensor (or a NumPy array, for host copies).
    """
    signed = str(records.dtype).endswith("int64") and not str(records.dtype).endswith("uint64")
    if not (signed or str(records.dtype).endswith("uint64")):
        raise TypeError(f"error records must be int64 or uint64, got {records.dtype}")
    pairs = records.reshape(-1, 2)
    pairs[:, 0] = 0
    pairs[:, 1] = -1 if signed else np.uint64(NO_ERROR_KEY)


class KvaddrError(Exception):
    """Base class of kvaddr's exceptions."""


class KernelCompileError(KvaddrError):
    """kernels.cu failed to compile; the message carries the compiler log."""


class AddressingError(KvaddrError):
    """A step's inputs held bad values (raised by ``check()``).

    Attributes
    ----------
    mask : int
        OR of every error bit the step set (see :data:`ERROR_REASONS`).
    token, request, cache, bit : int
        The first bad record (by token index, then request, cache and bit):
        its token (a request's first token for errors about the request's
        lengths or pages), its request, the cache it concerns (0 for errors
        that concern no cache) and that error's bit.
    """

    def __init__(self, mask: int, key: int):
        self.mask = int(mask)
        self.token, self.request, self.cache, self.bit = decode_error_key(key)
        reasons = ", ".join(f"{b} ({ERROR_REASONS[b]})" for b in sorted(ERROR_REASONS) if self.mask & b)
        where = f"token {self.token} of request {self.request}"
        if self.bit in CACHE_ERRORS:
            where += f", cache {self.cache}"
        super().__init__(
            f"bad step addressing: first bad value at {where}: {ERROR_REASONS[self.bit]}; "
            f"error bits {self.mask}: {reasons}"
        )


class EnvironmentProblem(KvaddrError):
    """The machine cannot run what was asked (no GPU, no CuPy, kernels do not compile)."""


class PlotUnavailable(EnvironmentProblem):
    """matplotlib is not installed; the message says how to install it."""


class CheckFailed(KvaddrError):
    """A strategy disagreed with the reference (or its step raised)."""


class StrategyLimitExceeded(KvaddrError, ValueError):
    """A step larger than a strategy can run (the one-block strategy: at most 1024 requests).

    Attributes
    ----------
    strategy : str
    limit : int
        The most requests the strategy runs in one step.
    bsz : int
        The requests of the step asked for.
    """

    def __init__(self, strategy: str, limit: int, bsz: int, why: str = ""):
        self.strategy, self.limit, self.bsz = strategy, int(limit), int(bsz)
        super().__init__(
            f"{strategy} runs at most {self.limit} requests{f' ({why})' if why else ''}, got bsz={self.bsz}"
        )


class ProfileConfigError(KvaddrError, ValueError):
    """A profile run's settings are invalid.

    Attributes
    ----------
    fields : tuple of str
        The settings at fault (:class:`kvaddr.measure.profile_run.ProfileConfig`
        field names, e.g. ``("context", "block_sizes")``).
    """

    def __init__(self, message: str, fields: tuple = ()):
        super().__init__(message)
        self.fields = tuple(fields)


class ProfileError(KvaddrError):
    """A workload profile (TOML) cannot be found, parsed or applied.

    Attributes
    ----------
    path : str or None
        The file (None when no file was found).
    line : int or None
        1-based line of the offending key, when known.
    key : str or None
        The offending key, as ``table.key`` or a top-level key.
    """

    def __init__(self, message: str, path: str | None = None, line: int | None = None, key: str | None = None):
        self.path, self.line, self.key = path, line, key
        where = ""
        if path is not None:
            where = f"{path}, line {line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


class TraceError(KvaddrError):
    """The trace cannot be read at all (missing file, unreadable header)."""


class NotATraceError(TraceError):
    """The file is not a kvaddr trace at all (empty, binary, another JSON document).

    Its message starts with ``not a kvaddr trace: ``.
    """


class AllocatorError(KvaddrError, RuntimeError):
    """The allocator was misused (a block freed twice or never allocated): a simulator bug."""


class BaselineError(KvaddrError):
    """A baseline file cannot be read, or is not a kvaddr baseline (or profile report)."""


class BaselineMismatch(BaselineError):
    """A baseline file holds runs of another machine than the runs being saved to it."""


class BaselineWriteError(BaselineError):
    """A baseline file cannot be written."""


class RevisionError(KvaddrError):
    """A git revision to time against cannot be used (``kvaddr check --against``): no git
    repository, no such revision, no kvaddr package in it, or its ``kvaddr profile`` cannot
    run the asked options."""


class SideFailed(KvaddrError):
    """One side's ``kvaddr profile`` process of an A/B run failed.

    Attributes
    ----------
    status : int
        The process's exit status (negative: the signal that ended it).
    """

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
