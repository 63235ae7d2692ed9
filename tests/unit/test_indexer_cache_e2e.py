"""End to end through the indexer's K cache on the CPU (the twin of
tests/gpu/test_indexer_cache_e2e_gpu.py): the NumPy reference's DSA offsets
(kvaddr.reference.step_addressing with ``dsa=True``) place random fp8 keys and fp32 scales in a
``[blocks, B * 132]`` byte cache exactly where the layout puts them, and the scorer's block read
(values first, then scales) returns every token's key; NumPy and torch (CPU) versions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.reference import step_addressing
from tests.support import indexer_cache as ic


def _step(rng, bsz, B, n):
    dec, q, table, nb = ic.step_inputs(rng, bsz, B, n=n)
    C = int(q.sum()) + 3
    out = step_addressing(dec, q, table, B, C, dsa=True, dsa_decode_len=n).outputs
    return out, table, nb, C


@settings(max_examples=25, deadline=None)
@given(bsz=st.integers(1, 12), B=st.sampled_from([64, 48, 7]), n=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_numpy_write_and_scorer_read(bsz, B, n, seed):
    rng = np.random.default_rng(seed)
    out, table, nb, C = _step(rng, bsz, B, n)
    values, scales = ic.keys(rng, C)
    req, pos = out.batch_id_per_token.astype(np.int64), out.position_ids.astype(np.int64)
    cache = np.zeros((nb, B * (ic.V + ic.S)), np.uint8)
    ic.write_numpy(cache, out.dsa.value_offsets, out.dsa.scale_offsets, values, scales)
    np.testing.assert_array_equal(cache, ic.expected_cache(nb, B, table, req, pos, values, scales))
    real = req >= 0
    vals, sc = ic.read_numpy(cache, B, table, req[real], pos[real])
    np.testing.assert_array_equal(vals, values[real])
    np.testing.assert_array_equal(sc.view(np.uint32), scales[real].view(np.uint32))


@pytest.mark.parametrize("B", [64, 48])
def test_torch_write_and_scorer_read_on_the_cpu(B):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(B)
    out, table, nb, C = _step(rng, 9, B, 2)
    values, scales = ic.keys(rng, C)
    req, pos = out.batch_id_per_token.astype(np.int64), out.position_ids.astype(np.int64)
    cache = torch.zeros((nb, B * (ic.V + ic.S)), dtype=torch.uint8)
    ic.write_torch(
        cache,
        torch.from_numpy(out.dsa.value_offsets),
        torch.from_numpy(out.dsa.scale_offsets),
        torch.from_numpy(values),
        torch.from_numpy(scales),
    )
    np.testing.assert_array_equal(cache.numpy(), ic.expected_cache(nb, B, table, req, pos, values, scales))
    real = req >= 0
    vals, sc = ic.read_torch(
        cache, B, torch.from_numpy(table).long(), torch.from_numpy(req[real]), torch.from_numpy(pos[real])
    )
    np.testing.assert_array_equal(vals.numpy(), values[real])
    np.testing.assert_array_equal(sc.numpy().view(np.uint32), scales[real].view(np.uint32))


def test_a_wrong_offset_is_caught():
    """The check can fail: a scale written one slot over is found."""
    rng = np.random.default_rng(3)
    out, table, nb, C = _step(rng, 4, 64, 1)
    values, scales = ic.keys(rng, C)
    req, pos = out.batch_id_per_token.astype(np.int64), out.position_ids.astype(np.int64)
    cache = np.zeros((nb, 64 * 132), np.uint8)
    scale_off = out.dsa.scale_offsets.copy()
    scale_off[0] += ic.S
    ic.write_numpy(cache, out.dsa.value_offsets, scale_off, values, scales)
    assert not np.array_equal(cache, ic.expected_cache(nb, 64, table, req, pos, values, scales))
