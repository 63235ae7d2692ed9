"""The bad-input matrix (docs/bad-inputs.md): one Row per table row, each a test.

A row's `kind` says what kvaddr does:
  host    raises at once, naming the argument (exc, message regex)
  device  runs, sets error bit(s) on the device and pads the bad tokens (-1 slots)
  valid   an edge case that is not an error at all
`where` lists the paths the row is tested on: "cpu" (the reference and the CPU
strategies) and/or "gpu" (StepPlanner and the GPU strategies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

I32 = np.int32


def _a(x, dtype=I32):
    return np.asarray(x, dtype=dtype)


def base(**over):
    case = dict(
        seq_lens_decoder=_a([5, 0, 9]),
        seq_lens_this_time=_a([1, 3, 2]),
        block_tables=_a([[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]]),
        block_sizes=[4],
        capacity=8,
    )
    case.update(over)
    return case


@dataclass
class Row:
    id: str
    kind: str  # host | device | valid
    make: Callable[[], dict]
    exc: type | None = None
    message: str = ""
    bits: int = 0
    where: tuple = ("cpu", "gpu")
    max_requests: int | None = None
    check: Callable | None = field(default=None)


def _strided_table():
    wide = _a(np.arange(24).reshape(4, 6))
    return wide.T  # a transposed view: last-dim stride 6 elements


ROWS = [
    Row(
        "int64-table",
        "host",
        lambda: base(block_tables=base()["block_tables"].astype(np.int64)),
        TypeError,
        r"block_tables must be int32 .*got dtype int64",
    ),
    Row(
        "float-lengths",
        "host",
        lambda: base(seq_lens_this_time=_a([1.0, 3.0, 2.0], np.float32)),
        TypeError,
        r"seq_lens_this_time must be int32 .*got dtype float32",
    ),
    Row(
        "rank-2-lengths",
        "host",
        lambda: base(seq_lens_decoder=_a([[5, 0, 9]])),
        ValueError,
        r"seq_lens_decoder must be int32 with shape \(bsz,\), got shape \(1, 3\)",
    ),
    Row(
        "rank-1-table",
        "host",
        lambda: base(block_tables=_a([7, 2, -1, -1])),
        ValueError,
        r"block_tables must be int32 with shape \(rows >= bsz, max_blocks\).*got shape \(4,\)",
    ),
    Row(
        "transposed-table",
        "host",
        lambda: base(block_tables=_strided_table()),
        ValueError,
        r"block_tables must be int32 .*last-dim stride of 6 elements \(a transposed or strided view\)",
    ),
    Row(
        "table-too-few-rows",
        "host",
        lambda: base(block_tables=base()["block_tables"][:2]),
        ValueError,
        r"block_tables must be .*got 2 rows for bsz = 3",
    ),
    Row(
        "batch-size-mismatch",
        "host",
        lambda: base(seq_lens_this_time=_a([1, 3])),
        ValueError,
        r"seq_lens_this_time must have shape \(bsz,\) = \(3,\)",
    ),
    Row(
        "too-many-requests",
        "host",
        lambda: base(),
        ValueError,
        r"seq_lens_decoder must have at most max_requests = 2 entries, got 3",
        max_requests=2,
    ),
    Row(
        "block-size-zero",
        "host",
        lambda: base(block_sizes=[0]),
        ValueError,
        r"block_sizes\[0\] must be an int in \[1, 2147483647\], got 0|block_size must be an int",
    ),
    Row(
        "block-size-negative",
        "host",
        lambda: base(block_sizes=[-64]),
        ValueError,
        r"block_size.* must be an int in \[1, 2147483647\], got -64",
    ),
    Row(
        "capacity-zero",
        "host",
        lambda: base(capacity=0),
        ValueError,
        r"capacity must be an int in \[1, 2147483646\], got 0",
    ),
    Row(
        "host-array-on-gpu-path",
        "host",
        lambda: base(),
        TypeError,
        r"seq_lens_decoder must be a CUDA array .*numpy.ndarray \(host memory\)",
        where=("gpu",),
    ),
    Row(
        "other-device",
        "host",
        lambda: base(),
        ValueError,
        r"must be on CUDA device 0, got an array in device 1",
        where=("cpu", "gpu"),
    ),
    Row("too-many-tokens", "device", lambda: base(capacity=4), bits=4),
    Row(
        "negative-lengths",
        "device",
        lambda: base(seq_lens_decoder=_a([5, -1, 9]), seq_lens_this_time=_a([1, 3, -2])),
        bits=8,
    ),
    Row(
        "unallocated-block",
        "device",
        lambda: base(block_tables=_a([[7, -1, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]])),
        bits=2,
    ),
    Row("block-index-beyond-row", "device", lambda: base(seq_lens_decoder=_a([5, 0, 16])), bits=1),
    # docs/attention.md: 6 kv_indices entries (pages [2, 1, 3]) for a capacity of 4
    Row(
        "kv-indices-capacity",
        "device",
        lambda: base(attention=("flashinfer",), kv_indices_capacity=4),
        bits=16,
        check=lambda o: (
            o.attention.kv_indices.tolist() == [[7, 2, 4, 1]] and o.attention.kv_indptr.tolist() == [[0, 2, 3, 6]]
        ),
    ),
    Row(
        "max-block-id-B-64",
        "valid",
        lambda: dict(
            seq_lens_decoder=_a([63, 64]),
            seq_lens_this_time=_a([1, 2]),
            block_tables=_a([[2**31 - 1, 2**31 - 1], [2**31 - 2, 2**31 - 1]]),
            block_sizes=[64],
            capacity=4,
        ),
        check=lambda o: (
            o.slot_mapping[0].tolist() == [(2**31 - 1) * 64 + 63, (2**31 - 1) * 64, (2**31 - 1) * 64 + 1, -1]
        ),
    ),
    Row(
        "empty-batch",
        "valid",
        lambda: dict(
            seq_lens_decoder=_a([]),
            seq_lens_this_time=_a([]),
            block_tables=np.zeros((0, 4), I32),
            block_sizes=[16],
            capacity=8,
        ),
        check=lambda o: int(o.num_tokens) == 0 and (o.slot_mapping == -1).all() and (o.batch_id_per_token == -1).all(),
    ),
    Row(
        "idle-batch",
        "valid",
        lambda: base(seq_lens_this_time=_a([0, 0, 0])),
        check=lambda o: (
            o.cu_seqlens_q.tolist() == [0, 0, 0, 0]
            and (o.slot_mapping == -1).all()
            and o.seq_lens_kv.tolist() == [5, 0, 9]
        ),
    ),
]

BY_ID = {r.id: r for r in ROWS}


def reference_for(case):
    """The NumPy reference's result for a matrix row's case (a dict of step_addressing's arguments)."""
    from kvaddr.reference import step_addressing

    c = dict(case)
    return step_addressing(
        c.pop("seq_lens_decoder"),
        c.pop("seq_lens_this_time"),
        c.pop("block_tables"),
        c.pop("block_sizes"),
        c.pop("capacity"),
        **c,
    )
