"""Host-side input checks: every bad argument gets a clear error naming it."""

import numpy as np
import pytest

from kvaddr.reference import step_addressing

I32 = np.int32
DEC = np.array([5, 0], I32)
Q = np.array([1, 2], I32)
TABLE = np.array([[1, 2], [3, 4]], I32)


def call(dec=DEC, q=Q, table=TABLE, bs=16, cap=8, **kw):
    return step_addressing(dec, q, table, bs, cap, **kw)


@pytest.mark.parametrize("kwargs,exc,message", [
    (dict(table=TABLE.astype(np.int64)), TypeError, r"block_tables must be int32 with shape .*got dtype int64"),
    (dict(dec=DEC.astype(np.float32)), TypeError, r"seq_lens_decoder must be int32 .*got dtype float32"),
    (dict(q=Q.astype(np.float64)), TypeError, r"seq_lens_this_time must be int32 .*float64"),
    (dict(table=TABLE[0]), ValueError, r"block_tables must be int32 with shape \(rows >= bsz, max_blocks\).*got shape \(2,\)"),
    (dict(dec=TABLE), ValueError, r"seq_lens_decoder must be int32 with shape \(bsz,\), got shape \(2, 2\)"),
    (dict(table=np.asfortranarray(np.arange(6, dtype=I32).reshape(2, 3))), ValueError, r"block_tables .*last-dim stride"),
    (dict(table=np.arange(6, dtype=I32).reshape(3, 2).T), ValueError, r"block_tables .*transposed or strided"),
    (dict(q=np.array([1, 2, 3], I32)), ValueError, r"seq_lens_this_time must have shape \(bsz,\) = \(2,\)"),
    (dict(table=TABLE[:1]), ValueError, r"block_tables must be .*got 1 rows for bsz = 2"),
    (dict(bs=0), ValueError, r"block_size.* must be an int in \[1, 2147483647\], got 0"),
    (dict(bs=-4), ValueError, r"block_size.* got -4"),
    (dict(bs=[16, 0], table=[TABLE, TABLE]), ValueError, r"block_sizes\[1\] must be an int"),
    (dict(bs=[16, 16], table=[TABLE]), ValueError, r"block_tables must be one array or a sequence of 2"),
    (dict(cap=0), ValueError, r"capacity must be an int in \[1, 2147483646\], got 0"),
    (dict(seq_lens_encoder=np.array([1], I32)), ValueError, r"seq_lens_encoder must have shape \(bsz,\) = \(2,\)"),
    (dict(table=np.zeros((2, 0), I32)), ValueError, r"block_tables .*max_blocks = 0"),
    (dict(dec=DEC[::2].repeat(1)[:1].reshape(1)), ValueError, r"seq_lens_this_time must have shape"),
    (dict(dec=np.arange(4, dtype=I32)[::2]), ValueError, r"seq_lens_decoder must be contiguous"),
])
def test_bad_inputs_name_the_argument(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        call(**kwargs)


def test_lists_are_accepted_as_int32():
    r = call(dec=[5, 0], q=[1, 2])
    assert r.outputs.cu_seqlens_q.tolist() == [0, 1, 3]


def test_out_of_range_list_is_rejected():
    with pytest.raises(ValueError, match="seq_lens_decoder must be int32 .*out of int32 range"):
        call(dec=[2**31, 0])
