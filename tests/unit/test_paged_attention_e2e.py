"""End-to-end paged attention in NumPy (docs/attention.md, "Testing"): K/V written through
each step's slot_mapping are read back through kv_indptr/kv_indices/kv_last_page_len and
through page_table + seqused_k, and attention on them equals attention on contiguous K/V."""

import numpy as np
import pytest

from kvaddr.reference import step_addressing
from kvaddr.strategies import cpu as cpu_strategies
from tests.support.paged_attention import ALL_GROUPS, NumpyBackend, Simulation, causal_attention_numpy, run_e2e


def reference_compute(sim):
    def compute(dec, q, tables):
        res = step_addressing(
            dec, q, tables, list(sim.block_sizes), 64, attention=ALL_GROUPS, kv_indices_capacity=sim.kv_indices_capacity
        )
        res.check()
        return res.outputs

    return compute


def strategy_compute(sim, name):
    s = cpu_strategies.make_strategy(
        name,
        max_requests=sim.num_requests,
        capacity=64,
        block_sizes=list(sim.block_sizes),
        num_layers=2,
        attention=ALL_GROUPS,
        kv_indices_capacity=sim.kv_indices_capacity,
    )

    def compute(dec, q, tables):
        out = s.step(dec, q, tables)
        s.check()
        return out

    return compute


@pytest.mark.parametrize("seed", range(4))
def test_reference_metadata_reads_what_the_slots_wrote(seed):
    sim = Simulation(num_requests=7, steps=8, block_sizes=(4, 3), seed=seed)
    report = run_e2e(sim, reference_compute(sim), NumpyBackend())
    assert report.ok, report.failures[:5]
    assert report.checks > 50
    assert {"tokens", "idle"} <= report.kinds


@pytest.mark.parametrize("name", ["fused", "hoisted", "per-layer"])
def test_cpu_strategies_metadata_reads_what_the_slots_wrote(name):
    sim = Simulation(num_requests=6, steps=6, block_sizes=(16, 1, 5), seed=11)
    report = run_e2e(sim, strategy_compute(sim, name))
    assert report.ok, report.failures[:5]


def test_a_corrupted_kv_indices_entry_fails():
    """The comparison can fail: point one page of a long request at another block."""
    sim = Simulation(num_requests=6, steps=5, block_sizes=(4,), seed=2)
    hit = []

    def corrupt(step, meta):
        if step != 4:
            return
        indptr, idx = meta["kv_indptr"][0], meta["kv_indices"][0]
        b = int(np.argmax(np.diff(indptr)))  # the request with the most pages
        lo = int(indptr[b])
        other = [int(x) for x in idx[: int(indptr[-1])] if x != idx[lo]]
        idx[lo] = other[0]
        hit.append(b)

    report = run_e2e(sim, reference_compute(sim), corrupt=corrupt, paths=("flashinfer",))
    assert hit and not report.ok
    assert any(f"request {hit[0]} cache 0 flashinfer: attention differs" in f for f in report.failures)
    assert all("step 4" in f for f in report.failures)


def test_a_wrong_seqused_k_fails_the_page_table_path():
    sim = Simulation(num_requests=5, steps=4, block_sizes=(4,), seed=5)

    def corrupt(step, meta):
        if step == 3:
            meta["seqused_k"][int(np.argmax(meta["seqused_k"]))] -= 1

    report = run_e2e(sim, reference_compute(sim), corrupt=corrupt, paths=("page_table",))
    assert not report.ok and any("page_table: read" in f for f in report.failures)


def test_numpy_attention_is_causal_by_position():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 2, 4)).astype(np.float32) for n in (2, 5, 5))
    out = causal_attention_numpy(q, k, v, np.array([0, 4]), np.arange(5))
    np.testing.assert_allclose(out[0], v[0], rtol=1e-12)  # position 0 sees only key 0
    changed = v.copy()
    changed[4] += 1
    again = causal_attention_numpy(q, k, changed, np.array([0, 3]), np.arange(5))
    np.testing.assert_allclose(again, causal_attention_numpy(q, k, v, np.array([0, 3]), np.arange(5)))
