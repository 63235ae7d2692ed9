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


@pytest.mark.parametrize(
    "kwargs,exc,message",
    [
        (dict(table=TABLE.astype(np.int64)), TypeError, r"block_tables must be int32 with shape .*got dtype int64"),
        (dict(dec=DEC.astype(np.float32)), TypeError, r"seq_lens_decoder must be int32 .*got dtype float32"),
        (dict(q=Q.astype(np.float64)), TypeError, r"seq_lens_this_time must be int32 .*float64"),
        (
            dict(table=TABLE[0]),
            ValueError,
            r"block_tables must be int32 with shape \(rows >= bsz, max_blocks\).*got shape \(2,\)",
        ),
        (dict(dec=TABLE), ValueError, r"seq_lens_decoder must be int32 with shape \(bsz,\), got shape \(2, 2\)"),
        (
            dict(table=np.asfortranarray(np.arange(6, dtype=I32).reshape(2, 3))),
            ValueError,
            r"block_tables .*last-dim stride",
        ),
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
    ],
)
def test_bad_inputs_name_the_argument(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        call(**kwargs)


def test_lists_are_accepted_as_int32():
    r = call(dec=[5, 0], q=[1, 2])
    assert r.outputs.cu_seqlens_q.tolist() == [0, 1, 3]


def test_out_of_range_list_is_rejected():
    with pytest.raises(ValueError, match="seq_lens_decoder must be int32 .*out of int32 range"):
        call(dec=[2**31, 0])


# ----------------------------------------------------------------------------- streams


def test_stream_handle_accepts_handles_cuda_stream_attributes_and_the_protocol():
    from kvaddr.validation import stream_handle

    class CupyLike:
        ptr = 11

    class TorchLike:
        cuda_stream = 22

    class Protocol:
        def __cuda_stream__(self):
            return (0, 33)

    assert [stream_handle(s) for s in (7, CupyLike(), TorchLike(), Protocol())] == [7, 11, 22, 33]
    for bad in ("fast", True, 1.5, object()):
        with pytest.raises(TypeError, match="stream must be a CuPy stream, a raw handle"):
            stream_handle(bad)

    class BadProtocol:
        def __cuda_stream__(self):
            return 33

    with pytest.raises(TypeError, match=r"stream.__cuda_stream__\(\) must return \(version, handle\)"):
        stream_handle(BadProtocol())


@pytest.mark.parametrize("has_from_external", [True, False])
def test_cupy_stream_wraps_a_handle_without_owning_it(monkeypatch, has_from_external):
    """CuPy 14 deprecates ExternalStream for Stream.from_external; older CuPy has only ExternalStream."""
    import sys
    import types

    from kvaddr.validation import cupy_stream

    made = []

    class Stream:
        pass

    if has_from_external:

        def from_external(obj):
            made.append(("from_external", obj.__cuda_stream__()))
            return "wrapped"

        Stream.from_external = staticmethod(from_external)

    def external(ptr):
        made.append(("ExternalStream", ptr))
        return "wrapped"

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=external)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert cupy_stream(1234) == "wrapped"
    assert made == ([("from_external", (0, 1234))] if has_from_external else [("ExternalStream", 1234)])
