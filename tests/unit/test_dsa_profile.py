"""kvaddr.measure.dsa_profile on the CPU (``kvaddr profile --dsa``): the per-layer design's
indexer metadata (array operations, NumPy here) equals the NumPy reference of the step's DSA
outputs on decode, MTP and mixed steps; the top-k rows it times stay inside each token's
context; the two conversions it times (kvaddr.strategies.dsa_topk's, checked first); the report; the command without a GPU. The timed GPU run is
tests/gpu/test_dsa_profile_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.measure import dsa_profile
from kvaddr.reference import step_addressing
from tests.support import dsa_emulator
from tests.support.dsa_cases import dsa_case


@settings(max_examples=40, deadline=None)
@given(bsz=st.integers(1, 30), n=st.integers(1, 3), B=st.sampled_from([64, 48, 5]), seed=st.integers(0, 2**31))
def test_engine_metadata_matches_the_reference(bsz, n, B, seed):
    rng = np.random.default_rng(seed)
    dec, q, table = dsa_case(rng, bsz, n=n, width=80, max_pos=B * 60)
    T = int(q.sum())
    out = step_addressing(dec, q, table, B, T + 2, dsa=True, dsa_decode_len=n).outputs
    got = dsa_profile.engine_metadata(
        np, out.batch_id_per_token, out.position_ids, out.slot_mapping[0], out.seq_lens_kv, q, T, B, decode_len=n
    )
    for name, g in zip(("value_offsets", "scale_offsets", "ctx", "ks", "ke"), got[:5]):
        np.testing.assert_array_equal(g, getattr(out.dsa, name)[:T], err_msg=name)
    P = int((q > n).sum())
    np.testing.assert_array_equal(got[5][: P + 1], out.dsa.cu_seq_lens[: P + 1])


def test_random_topk_stays_inside_the_context():
    rng = np.random.default_rng(0)
    pos = np.array([0, 5, 3000, 2047, 2048])
    topk = dsa_profile.random_topk(rng, pos, 2048)
    assert topk.shape == (5, 2048) and topk.dtype == np.int32
    for t, p in enumerate(pos):
        row = topk[t]
        used = row[row >= 0]
        assert used.size == min(p + 1, 2048) and (used <= p).all() and np.unique(used).size == used.size
        assert (row[used.size :] == -1).all()


@pytest.mark.skipif(dsa_emulator.CXX is None, reason="no C++ compiler for the kernel emulator")
@pytest.mark.parametrize("T, K, B", [(1, 2048, 64), (6, 256, 64), (9, 130, 5)])
def test_conversions_are_the_strategies_and_checked(monkeypatch, T, K, B):
    """The profiler times kvaddr.strategies.dsa_topk's two conversions (the kernels emulated on
    the CPU), each checked against the reference first; a wrong one fails the check."""
    from kvaddr.dsa_reference import topk_to_slots
    from kvaddr.strategies.dsa_topk import BaselineTopkSlots, KvaddrTopkSlots
    from tests.support import dsa_fake_gpu

    launched = dsa_fake_gpu.install(monkeypatch)
    rng = np.random.default_rng(T)
    pos = rng.integers(0, 40 * B, T)
    width = int(pos.max()) // B + 1
    table = rng.permutation(T * width).astype(np.int32).reshape(T, width)
    rid = np.arange(T, dtype=np.int32)
    topk = dsa_profile.random_topk(rng, pos, K)
    ctx = (pos + 1).astype(np.int32)
    want = topk_to_slots(topk, rid, table, B, ctx)
    convs = dsa_profile.conversions(T, K, B)
    assert type(convs["per-layer"]) is BaselineTopkSlots and type(convs["kvaddr"]) is KvaddrTopkSlots
    f = dsa_fake_gpu.on_fake
    for design, strategy in convs.items():
        out = dsa_profile.check_conversion(design, strategy, f(topk), f(rid), f(table), f(ctx), want)
        assert (out.valid_counts is None) == (design == "per-layer")
    assert {name for name, _, _ in launched} >= {"kvaddr_dsa_topk_baseline"}
    assert any(name.startswith("dsa_topk_slots") for name, _, _ in launched)
    bad = want.slots.copy()
    bad[0, 0] = 12345
    with pytest.raises(AssertionError, match="kvaddr conversion: slots"):
        dsa_profile.check_conversion(
            "kvaddr",
            convs["kvaddr"],
            f(topk),
            f(rid),
            f(table),
            f(ctx),
            type(want)(bad, *[getattr(want, k) for k in list(want.__dataclass_fields__)[1:]]),
        )
    assert set(dsa_profile.CONVERSION_ABOUT) == set(convs)


def test_format_rows():
    row = dsa_profile.DsaProfileRow(64, 61, 2048, 20.0, 0.5, 3.0, 2.0, {"a": "x: y"})
    text = dsa_profile.format_rows([row])
    assert "per decode step" in text and "x: y" in text
    assert row.per_layer_design_us == 20.0 + 61 * 3.0 and row.kvaddr_us == 0.5 + 61 * 2.0
    assert f"{row.per_layer_design_us / row.kvaddr_us:.2f}" in text
    assert row.as_dict()["kvaddr_us"] == row.kvaddr_us


def test_command_without_a_gpu_exits_3(monkeypatch):
    from kvaddr import cli
    from kvaddr.measure import environment

    monkeypatch.setattr(environment, "use_gpu", lambda device=None: (False, "no device here"))
    r = CliRunner().invoke(cli.cli, ["profile", "--model", "deepseek-v3.2", "--dsa", "--batch", "64"])
    assert r.exit_code == 3, r.output
    assert "--dsa" in r.output and "no device here" in r.output
    r = CliRunner().invoke(cli.cli, ["profile", "--dsa", "--device", "cpu"])
    assert r.exit_code == 2 and "--device cpu" in r.output
