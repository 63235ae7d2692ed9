"""The vLLM step's bad-input matrix (docs/bad-inputs-vllm.md): one Row per table row.

A row's ``kind``:
  host    raises before any launch, naming the argument (exc, message regex);
          ``config`` rows raise when the planner (or VllmStepConfig) is built
  device  runs; sets ``bits`` on the device, ``key`` is the first-bad
          ``(token, request, group)``; bad tokens get slot -1, skipped requests are padding
  valid   an edge case that is not an error
``where``: "cpu" (the reference) and/or "gpu" (VllmStepPlanner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvaddr.engines import vllm_errors as E

I32 = np.int32


def _a(x, dtype=I32):
    return np.asarray(x, dtype=dtype)


def config(**over) -> dict:
    c = dict(max_num_reqs=4, max_num_batched_tokens=6, block_sizes=[4], widths=[4])
    c.update(over)
    return c


def inputs(**over) -> dict:
    x = dict(
        idx_mapping=_a([2, 0]),
        query_start_loc=_a([0, 1, 3]),
        num_computed_tokens=_a([9, 0, 5, 0]),
        block_tables=[_a([[1, 3, 8, -1], [0, 0, 0, 0], [7, 2, -1, -1], [0, 0, 0, 0]])],
        num_blocks=[_a([3, 0, 2, 0])],
    )
    x.update(over)
    return x


@dataclass
class Row:
    id: str
    kind: str  # host | config | device | valid
    make: Callable[[], tuple]  # () -> (config kwargs, input kwargs)
    exc: type | None = None
    message: str = ""
    bits: int = 0
    key: tuple | None = None  # (token, request, group) of the first bad value
    where: tuple = ("cpu", "gpu")
    num_reqs_padded: int | None = None
    check: Callable | None = field(default=None)


def _case(cfg=None, **inp):
    return lambda: (config(**(cfg or {})), inputs(**inp))


ROWS = [
    Row(
        "idx-float",
        "host",
        _case(idx_mapping=_a([2.0, 0.0], np.float32)),
        TypeError,
        r"idx_mapping must be int32 or int64 with shape \(num_reqs,\), got dtype float32",
    ),
    Row(
        "idx-rank-2",
        "host",
        _case(idx_mapping=_a([[2, 0]])),
        ValueError,
        r"idx_mapping must be int32 or int64 with shape \(num_reqs,\), got shape \(1, 2\)",
    ),
    Row(
        "too-many-requests",
        "host",
        _case(idx_mapping=_a([0, 1, 2, 3, 0]), query_start_loc=_a([0, 1, 2, 3, 4, 5])),
        ValueError,
        r"idx_mapping must have at most max_num_reqs = 4 entries, got 5",
    ),
    Row(
        "qsl-wrong-length",
        "host",
        _case(query_start_loc=_a([0, 1])),
        ValueError,
        r"query_start_loc must be int32 with shape \(num_reqs \+ 1,\) = \(3,\), got shape \(2,\)",
    ),
    Row(
        "qsl-int64",
        "host",
        _case(query_start_loc=_a([0, 1, 3], np.int64)),
        TypeError,
        r"query_start_loc must be int32 .*got dtype int64",
    ),
    Row(
        "computed-too-short",
        "host",
        _case(num_computed_tokens=_a([9, 0, 5])),
        ValueError,
        r"num_computed_tokens must be int32 with shape \(rows >= max_num_reqs = 4,\), got shape \(3,\)",
    ),
    Row(
        "table-wrong-width",
        "host",
        _case(block_tables=[np.zeros((4, 3), I32)]),
        ValueError,
        r"block_tables must be int32 with shape \(rows >= 4, width = 4\), got shape \(4, 3\)",
    ),
    Row(
        "table-transposed",
        "host",
        _case(block_tables=[np.zeros((4, 4), I32).T]),
        ValueError,
        r"block_tables must have a contiguous last dim, got a last-dim stride of 4 elements",
    ),
    Row(
        "table-int64",
        "host",
        _case(block_tables=[np.zeros((4, 4), np.int64)]),
        TypeError,
        r"block_tables must be int32 .*got dtype int64",
    ),
    Row(
        "tables-per-group",
        "host",
        lambda: (
            config(block_sizes=[4, 16], widths=[4, 4]),
            inputs(num_blocks=[_a([3, 0, 2, 0])] * 2),
        ),
        ValueError,
        r"block_tables must be a sequence of 2 arrays \(one per group\), got 1",
    ),
    Row(
        "num-blocks-short",
        "host",
        _case(num_blocks=[_a([3, 0])]),
        ValueError,
        r"num_blocks must be int32 with shape \(rows >= max_num_reqs = 4,\), got shape \(2,\)",
    ),
    Row(
        "padded-below-num-reqs",
        "host",
        _case(),
        ValueError,
        r"num_reqs_padded must be an int in \[2, 4\], got 1",
        num_reqs_padded=1,
    ),
    Row(
        "padded-above-max",
        "host",
        _case(),
        ValueError,
        r"num_reqs_padded must be an int in \[2, 4\], got 5",
        num_reqs_padded=5,
    ),
    Row(
        "interleave-not-dividing-B",
        "config",
        _case(cfg=dict(cp_size=2, cp_interleave=3)),
        ValueError,
        r"cp_interleave must divide block_sizes\[0\] = 4, got 3",
    ),
    Row(
        "rank-out-of-range",
        "config",
        _case(cfg=dict(cp_size=2, cp_rank=2)),
        ValueError,
        r"cp_rank must be an int in \[0, 1\], got 2",
    ),
    Row(
        "sliding-window-under-dcp",
        "config",
        _case(cfg=dict(cp_size=2, sliding_window_reach=[8])),
        ValueError,
        r"sliding_window_reach\[0\] must be 0 for a DCP-sharded group when cp_size > 1, got 8",
    ),
    Row(
        "five-groups",
        "config",
        _case(cfg=dict(block_sizes=[4] * 5, widths=[4] * 5)),
        ValueError,
        r"block_sizes must name 1 to 4 groups, got 5",
    ),
    Row(
        "slot-dtype-float",
        "config",
        _case(cfg=dict(slot_dtype=np.float32)),
        TypeError,
        r"slot_dtype must be int64 or int32, got float32",
    ),
    Row(
        "host-array-on-gpu-path",
        "host",
        _case(),
        TypeError,
        r"idx_mapping must be a CUDA array .*numpy.ndarray \(host memory\)",
        where=("gpu",),
    ),
    Row(
        "out-wrong-dtype",
        "config",
        _case(),
        TypeError,
        r"out.positions must be int64 with shape \(6,\), got dtype int32",
        where=("gpu",),
    ),
    Row("row-index-past-max", "device", _case(idx_mapping=_a([2, 4])), bits=E.VERR_ROW_INDEX, key=(1, 1, 0)),
    Row("row-index-below-dummy", "device", _case(idx_mapping=_a([-2, 0])), bits=E.VERR_ROW_INDEX, key=(0, 0, 0)),
    Row(
        "qsl-decreasing",
        "device",
        _case(query_start_loc=_a([0, 2, 1])),
        bits=E.VERR_QUERY_START_LOC,
        key=(2, 1, 0),
    ),
    Row(
        "qsl-past-capacity",
        "device",
        _case(
            query_start_loc=_a([0, 1, 9]),
            block_tables=[_a([[1, 3, 8, 6], [0] * 4, [7, 2, -1, -1], [0] * 4])],
            num_blocks=[_a([4, 0, 2, 0])],
        ),
        bits=E.VERR_CAPACITY,
        key=(6, 1, 0),
        check=lambda o: o.positions.tolist() == [5, 9, 10, 11, 12, 13],
    ),
    Row(
        "negative-computed",
        "device",
        _case(num_computed_tokens=_a([9, 0, -5, 0])),
        bits=E.VERR_NEGATIVE_COMPUTED,
        key=(0, 0, 0),
        check=lambda o: o.seq_lens.tolist() == [0, 11, 0, 0] and int(o.slot_mappings[0, 0]) == -1,
    ),
    Row(
        "block-index-past-width",
        "device",
        _case(num_computed_tokens=_a([16, 0, 5, 0])),
        bits=E.VERR_BLOCK_INDEX,
        key=(1, 1, 0),
    ),
    Row(
        "block-index-past-num-blocks",
        "device",
        _case(num_computed_tokens=_a([11, 0, 5, 0])),
        bits=E.VERR_PAST_NUM_BLOCKS,
        key=(2, 1, 0),
        check=lambda o: o.slot_mappings[0].tolist() == [9, 35, -1, -1, -1, -1],
    ),
    Row(
        "negative-block-id",
        "device",
        _case(block_tables=[_a([[1, 3, -1, -1], [0] * 4, [7, 2, -1, -1], [0] * 4])]),
        bits=E.VERR_NEGATIVE_BLOCK,
        key=(1, 1, 0),
    ),
    Row(
        "num-blocks-past-width",
        "device",
        _case(num_blocks=[_a([5, 0, 2, 0])]),
        bits=E.VERR_NUM_BLOCKS,
        key=(1, 1, 0),
        check=lambda o: o.input_block_tables[0][1].tolist() == [1, 3, 8, -1],
    ),
    Row(
        "int32-slot-overflow",
        "device",
        lambda: (
            config(block_sizes=[64], slot_dtype=np.int32),
            inputs(block_tables=[_a([[1, 3, 8, -1], [0] * 4, [2**30, 2, -1, -1], [0] * 4])]),
        ),
        bits=E.VERR_SLOT_INT32,
        key=(0, 0, 0),
        check=lambda o: o.slot_mappings[0].tolist() == [-1, 73, 74, -1, -1, -1],
    ),
    Row(
        "max-block-id-int64",
        "valid",
        lambda: (
            config(block_sizes=[64]),
            inputs(block_tables=[_a([[1, 3, 8, -1], [0] * 4, [2**31 - 1, 2, -1, -1], [0] * 4])]),
        ),
        check=lambda o: int(o.slot_mappings[0, 0]) == (2**31 - 1) * 64 + 5,
    ),
    Row(
        "empty-batch",
        "valid",
        _case(idx_mapping=_a([]), query_start_loc=_a([0])),
        check=lambda o: (o.slot_mappings == -1).all() and (o.positions == 0).all() and (o.seq_lens == 0).all(),
    ),
    Row(
        "all-dummy",
        "valid",
        _case(idx_mapping=_a([-1, -1])),
        check=lambda o: (
            (o.slot_mappings == -1).all() and (o.seq_lens == 0).all() and (o.input_block_tables[0] == 0).all()
        ),
    ),
]
