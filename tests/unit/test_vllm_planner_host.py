"""VllmStepPlanner's and VllmThreeLaunch's host side on the CPU, with a minimal fake CuPy:
the parameter struct each launch receives (read back from the launch's parameter
pointer), the grids, the identity cache and the checks before any launch."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr import dispatch
from tests.support.vllm_fake_cupy import FakeArray, install


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


def _worked(G=1):
    from tests.support.vllm_cases import worked_example

    cfg, x = worked_example(block_sizes=[4] * G, widths=[4] * G)
    x["block_tables"] = x["block_tables"] * G
    x["num_blocks"] = x["num_blocks"] * G
    dev = {k: ([FakeArray(a) for a in v] if isinstance(v, list) else FakeArray(v)) for k, v in x.items()}
    del cfg
    return x, dev


NAMES = ("idx_mapping", "query_start_loc", "num_computed_tokens", "block_tables", "num_blocks")


def test_one_launch_struct_and_grid(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    _, d = _worked(G=2)
    pl = VllmStepPlanner(4, 6, [4, 4], [4, 4], slot_mapping_enabled=[True, False], cp_size=2, cp_rank=1)
    out = pl.compute(*(d[k] for k in NAMES), num_reqs_padded=3, stream=77)
    assert len(fake.launches) == 1
    L = fake.launches[0]
    p = L["params"]
    assert L["fn"] == fake.names[dispatch.vllm_kernel(False)] and L["stream"] == 77 and L["block"] == 256
    # grid: ceil(6/256) token blocks + ceil(4/256) request blocks + ceil(2 groups * 2 rows * 32 lanes / 256)
    assert L["grid"] == (3, 1, 1) and p["token_blocks"] == 1 and p["request_blocks"] == 1
    assert p["idx_mapping"] == d["idx_mapping"].data.ptr and p["idx_is_64"] == 0
    assert p["query_start_loc"] == d["query_start_loc"].data.ptr
    assert p["num_computed_tokens"] == d["num_computed_tokens"].data.ptr
    assert p["block_table"][:2] == [t.data.ptr for t in d["block_tables"]]
    assert p["table_stride"][:2] == [4, 4] and p["num_blocks"][:2] == [t.data.ptr for t in d["num_blocks"]]
    assert p["positions"] == out.positions.data.ptr and p["seq_lens"] == out.seq_lens.data.ptr
    assert p["slot_mappings"] == out.slot_mappings.data.ptr and p["slot_stride"] == 6
    assert p["gathered"][:2] == [t.data.ptr for t in out.input_block_tables] and p["gathered_stride"][:2] == [4, 4]
    assert p["dcp_local_seq_lens"] == out.dcp_local_seq_lens.data.ptr
    assert p["width"] == [4, 4, 1, 1] and p["block_size"] == [4, 4, 1, 1]
    assert p["group_flags"][:2] == [1 | 2, 2]  # group 1: slots disabled, sharded
    assert (p["num_groups"], p["num_reqs"], p["num_reqs_padded"], p["max_num_reqs"], p["max_tokens"]) == (2, 2, 3, 4, 6)
    assert (p["cp_size"], p["cp_rank"], p["cp_interleave"], p["slot_is_32"]) == (2, 1, 1, 0)
    assert p["row_fill"][1] - p["row_fill"][0] == 4 * 4  # [G, M] int32
    # the persistent scratch starts clean (the planner's tables are zeros) with clean error records
    assert pl._row_fill.a.tolist() == [[0] * 4, [0] * 4]
    assert pl._records.a.tolist() == [[0, 2**64 - 1]] * 16
    assert p["errors"] == pl._records.data.ptr


def test_struct_grid_and_records(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    _, d = _worked(G=2)
    pl = VllmStepPlanner(4, 600, [4, 4], [4, 4], cp_size=2, cp_rank=1)
    assert pl.kernel_name == dispatch.vllm_kernel(False)
    assert set(fake.names) == set(dispatch.vllm_kernels(False))  # compiled: the dispatch table's kernels only
    pl.compute(*(d[k] for k in NAMES), num_reqs_padded=3, stream=77)
    L = fake.launches[-1]
    p = L["params"]
    assert L["fn"] == fake.names[dispatch.vllm_kernel(False)] and L["stream"] == 77 and L["block"] == 256
    # ceil(600/256) = 3 token blocks + 1 request block + the gather: 2 groups x 2 real rows (not
    # the padded 3: rows past the batch are the request role's) x 32 lanes, in 256-thread blocks
    assert p["token_blocks"] == 3 and p["request_blocks"] == 1 and p["pair_lanes"] == 32
    assert L["grid"] == (3 + 1 + 1, 1, 1)
    # one (mask, first-bad key) record per warp of the token and request blocks
    assert pl._records.a.shape == ((3 + 1) * 8, 2)
    assert pl._records.a[:, 0].tolist() == [0] * 32 and pl._records.a[:, 1].tolist() == [2**64 - 1] * 32
    assert p["errors"] == pl._records.data.ptr
    assert pl.errors() == (0, 2**64 - 1)
    pl._records.a[5] = [8, 77]
    pl._records.a[9] = [1, 55]
    assert pl.errors() == (9, 55)  # the host reduces the records: OR of the masks, least key
    assert pl._records.a[:, 0].tolist() == [0] * 32 and pl._records.a[:, 1].tolist() == [2**64 - 1] * 32  # reset
    assert pl.errors() == (0, 2**64 - 1)


def test_a_caller_table_is_zeroed_in_full_by_the_first_call(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    mine = FakeArray(np.full((4, 5), 9, np.int32))
    pl = VllmStepPlanner(4, 6, [4, 4], [4, 5], out={"input_block_tables": [None, mine]})
    assert pl._row_fill.a.tolist() == [[0] * 4, [5] * 4]  # every entry of the caller's table may be non-zero
    assert pl.outputs.input_block_tables[1] is mine


def test_auto_pair_lanes():
    from kvaddr.engines.vllm import VllmStepPlanner

    lanes = VllmStepPlanner.auto_pair_lanes
    assert [lanes(1), lanes(512), lanes(513), lanes(4096), lanes(4097), lanes(8192)] == [32, 32, 16, 16, 8, 8]


@pytest.mark.parametrize("pairs", [1, 512, 513, 4096, 4097, 8192])
def test_grid_uses_auto_pair_lanes(fake, pairs):
    from kvaddr.engines.vllm import VllmStepPlanner

    pl = VllmStepPlanner(8192, 8, [4], [4])
    pl.grid(pairs)
    assert pl._params.pair_lanes == VllmStepPlanner.auto_pair_lanes(pairs)


def test_identity_cache_and_replacements(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    x, d = _worked()
    pl = VllmStepPlanner(4, 6, [4], [4])
    pl.compute(*(d[k] for k in NAMES))
    first = fake.launches[-1]["params"]
    new_table = FakeArray(np.zeros((8, 4), np.int32))
    d["block_tables"][0] = new_table  # the same list, a new element
    d["idx_mapping"] = FakeArray(x["idx_mapping"].astype(np.int64))
    pl.compute(*(d[k] for k in NAMES), num_reqs_padded=4)
    p = fake.launches[-1]["params"]
    assert p["block_table"][0] == new_table.data.ptr != first["block_table"][0]
    assert p["idx_is_64"] == 1 and p["num_reqs_padded"] == 4
    # a bad new object is checked (and refused) even though the old one was fine
    with pytest.raises(ValueError, match=r"num_computed_tokens must be int32 with shape \(rows >= max_num_reqs = 4,\)"):
        pl.compute(
            d["idx_mapping"], d["query_start_loc"], FakeArray(np.zeros(3, np.int32)), d["block_tables"], d["num_blocks"]
        )
    assert len(fake.launches) == 2


def test_host_checks_run_before_any_launch(fake):
    from kvaddr.engines.vllm import VllmStepPlanner

    _, d = _worked()
    pl = VllmStepPlanner(4, 6, [4], [4])
    with pytest.raises(TypeError, match=r"idx_mapping must be int32 or int64 .*got dtype float32"):
        pl.compute(FakeArray(np.zeros(2, np.float32)), *(d[k] for k in NAMES[1:]))
    with pytest.raises(ValueError, match=r"num_reqs_padded must be an int in \[2, 4\], got 9"):
        pl.compute(*(d[k] for k in NAMES), num_reqs_padded=9)
    with pytest.raises(TypeError, match=r"out.slot_mappings must be int64"):
        VllmStepPlanner(4, 6, [4], [4], out={"slot_mappings": FakeArray(np.zeros((1, 6), np.int32))})
    assert fake.launches == []


def test_three_launch_order_and_grids(fake):
    from kvaddr.strategies.vllm_three_launch import VllmThreeLaunch

    _, d = _worked(G=2)
    three = VllmThreeLaunch(4, 6, [4, 4], [4, 4])
    three.compute(*(d[k] for k in NAMES), num_reqs_padded=3)
    three.compute(*(d[k] for k in NAMES), num_reqs_padded=3)
    got = [(L["name"], L["grid"][:2], L["block"]) for L in fake.launches]
    assert got[:3] == [
        ("kvaddr_vllm3_prepare", (3, 1), 128),  # num_reqs + 1 programs
        ("kvaddr_vllm3_gather", (4, 2), 128),  # rows = max(padded, previous rows = max_num_reqs at first), groups
        ("kvaddr_vllm3_slots", (3, 2), 128),  # (num_reqs + 1, groups)
    ]
    assert got[4] == ("kvaddr_vllm3_gather", (3, 2), 128)  # the previous call filled 2 rows: max(3, 2)
