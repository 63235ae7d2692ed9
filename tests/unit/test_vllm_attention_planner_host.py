"""VllmStepPlanner(attention=...) host side on the CPU (fake CuPy): the kernel it picks (the
dispatch table's), the appended struct fields, the grid (num_groups * meta_blocks more blocks),
the error records, the buffers, the memoised path, and the option checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import dispatch
from tests.support.vllm_fake_cupy import install, on_fake

NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


def _worked(G=2, rows=4):
    from tests.support.vllm_cases import worked_example

    _, x = worked_example()
    pad = rows - 4
    x["num_computed_tokens"] = np.pad(x["num_computed_tokens"], (0, pad))
    x["block_tables"] = [np.pad(x["block_tables"][0], ((0, pad), (0, 0)))] * G
    x["num_blocks"] = [np.pad(x["num_blocks"][0], (0, pad))] * G
    return on_fake(x)


def test_struct_grid_records_and_buffers(fake):
    from kvaddr.engines.vllm import VllmStepPlanner, auto_meta_rows

    d = _worked(G=2, rows=300)
    pl = VllmStepPlanner(
        300,
        6,
        [4, 16],
        [4, 4],
        cp_size=2,
        dcp_sharded=[True, False],
        attention="flashinfer,varlen",
        kv_indices_capacity=1000,
    )
    assert pl.kernel_name == dispatch.vllm_kernel(True) and pl.attention == ("flashinfer", "varlen")
    out = pl.compute(*(d[k] for k in NAMES), num_reqs_padded=3, stream=5)
    L = fake.launches[-1]
    p = L["params"]
    assert L["name"] == dispatch.vllm_kernel(True)
    # meta blocks: ceil((300 + 1) / meta_rows) per group, after the step's blocks (1 token
    # block, 2 request blocks, ceil(2 groups * 2 rows * 32 lanes / 256) = 1 gather block)
    assert pl.meta_rows == auto_meta_rows(300, 2) == 16
    blocks = -(-301 // pl.meta_rows)
    assert p["meta_blocks"] == blocks and p["meta_rows"] == pl.meta_rows and pl.attention_blocks == 2 * blocks
    assert L["grid"] == (1 + 2 + 1 + 2 * blocks, 1, 1) and pl.grid(3, 2) == L["grid"][0]
    assert p["attention"] == 3 and p["kv_indices_capacity"] == 1000 and p["meta_entries"] == -(-1000 // blocks)
    a = out.attention
    assert a is pl.attention_outputs
    assert p["qo_indptr"] == a.qo_indptr.data.ptr and a.qo_indptr.shape == (301,)
    assert p["kv_indptr"] == a.kv_indptr.data.ptr and a.kv_indptr.shape == (2, 301)
    assert p["kv_indices"] == a.kv_indices.data.ptr and a.kv_indices.shape == (2, 1000)
    assert (a.kv_indices.a == -1).all()
    assert p["kv_last_page_len"] == a.kv_last_page_len.data.ptr and a.kv_last_page_len.shape == (2, 300)
    assert p["cu_seqlens_k"] == a.cu_seqlens_k.data.ptr and a.cu_seqlens_k.shape == (2, 301)
    assert p["max_seqlen"] == pl._max_seqlen.data.ptr and pl._max_seqlen.shape == (3,)
    assert a.max_seqlen_q.shape == () and a.max_seqlen_k.shape == (2,)
    # group 0 is sharded (its L is the local length), group 1 is not
    assert a.seqused_k[0] is out.dcp_local_seq_lens and a.seqused_k[1] is out.seq_lens
    # one error record per warp of the token, request and metadata blocks
    assert pl._records.shape == ((1 + 2 + 2 * blocks) * 8, 2)
    assert pl._records.shape == pl.error_records_shape(300, 6, attention_blocks=pl.attention_blocks)
    # the memoised path launches the same kernel with the same grid
    pl.compute(*(d[k] for k in NAMES), num_reqs_padded=3, stream=5)
    assert pl._memo is not None and fake.launches[-1]["grid"] == L["grid"]
    assert fake.launches[-1]["name"] == dispatch.vllm_kernel(True)


def test_without_attention_nothing_changes(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    d = _worked(G=1)
    pl = VllmStepPlanner(4, 6, [4], [4])
    out = pl.compute(*(d[k] for k in NAMES))
    L = fake.launches[-1]
    assert (
        L["name"] == dispatch.vllm_kernel(False) == pl.kernel_name
        and out.attention is None
        and pl.attention_outputs is None
    )
    assert L["params"]["attention"] == 0 and L["params"]["meta_blocks"] == 0
    assert L["grid"] == (1 + 1 + 1, 1, 1)
    assert pl._records.shape == (2 * 8, 2)


def test_varlen_only_and_page_table(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    d = _worked(G=1)
    pl = VllmStepPlanner(4, 6, [4], [4], attention=("varlen", "page_table"))
    out = pl.compute(*(d[k] for k in NAMES))
    p = fake.launches[-1]["params"]
    assert p["attention"] == 2 and p["kv_indptr"] is None and p["kv_indices_capacity"] == 0
    a = out.attention
    assert a.kv_indices is None and a.page_table is out.input_block_tables
    # page_table alone needs no metadata blocks: the kernel without attention
    pl = VllmStepPlanner(4, 6, [4], [4], attention="page_table")
    pl.compute(*(d[k] for k in NAMES))
    assert fake.launches[-1]["name"] == dispatch.vllm_kernel(False)
    assert pl.attention_outputs.page_table is pl.outputs.input_block_tables


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(attention="flashinfer"), ValueError, "kv_indices_capacity must be an int in"),
        (dict(attention="flashinfer", kv_indices_capacity=0), ValueError, "kv_indices_capacity must be"),
        (dict(attention="flashmla"), ValueError, "attention must name groups among"),
        (dict(attention=5), TypeError, "attention must be None"),
    ],
)
def test_option_checks(fake, kw, exc, match):
    from kvaddr.engines.vllm import VllmStepPlanner

    with pytest.raises(exc, match=match):
        VllmStepPlanner(4, 6, [4], [4], **kw)


def test_three_launch_refuses_attention(fake):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    with pytest.raises((ValueError, TypeError)):
        VllmThreeLaunch(4, 6, [4], [4], attention="varlen")


def test_reference_records_fit_the_key():
    from kvaddr.engines import vllm_errors as E

    k = E.vllm_error_key(7, 3, 2, E.VERR_KV_INDICES_CAPACITY)
    assert E.decode_vllm_error_key(k) == (7, 3, 2, 512)
    assert "group 2" in str(E.VllmAddressingError(512, k))
    np.testing.assert_equal(E.VERR_KV_INDICES_CAPACITY & E.GROUP_BITS, 512)


@pytest.mark.parametrize(
    ("M", "G", "rows"),
    [
        (128, 1, 16),  # decode 64: 9 blocks
        (2048, 2, 16),  # decode 1024, 2 groups: 2 * 129 = 258 <= 264
        (8192, 1, 32),  # decode 4096: 513 blocks at 16 rows > 264 -> 32 rows, 257 blocks
        (8192, 2, 64),  # 2 * 257 > 264 -> 64 rows, 2 * 129 = 258
        (8192, 4, 128),  # 4 * 65 = 260
        (1 << 16, 4, 256),  # nothing fits: 256 rows
        (4, 1, 16),
    ],
)
def test_auto_meta_rows(M, G, rows):
    from kvaddr.engines.vllm import META_BLOCKS_CAP, auto_meta_rows

    assert auto_meta_rows(M, G) == rows
    blocks = G * -(-(M + 1) // rows)
    assert blocks <= META_BLOCKS_CAP or rows == 256


def test_the_planner_takes_the_automatic_rows(fake):
    from kvaddr.engines.vllm import VllmStepPlanner, auto_meta_rows

    d = _worked(G=1, rows=300)
    pl = VllmStepPlanner(300, 6, [4], [4], attention="flashinfer", kv_indices_capacity=10)
    pl.compute(*(d[k] for k in NAMES))
    p = fake.launches[-1]["params"]
    assert p["meta_rows"] == pl.meta_rows == auto_meta_rows(300, 1)
    assert p["meta_blocks"] == -(-301 // pl.meta_rows) and p["meta_entries"] == -(-10 // p["meta_blocks"])
