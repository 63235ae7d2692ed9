"""kvaddr.measure.dsa_profile on the CPU (``kvaddr profile --dsa``): the per-layer design's
indexer metadata (array operations, NumPy here) equals the NumPy reference of the step's DSA
outputs on decode, MTP and mixed steps; the top-k rows it times stay inside each token's
context; the conversion registry; the report; the command without a GPU. The timed GPU run is
tests/gpu/test_dsa_profile_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaddr.measure import dsa_profile
from kvaddr.reference import step_addressing
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


def test_register_conversion():
    before = dict(dsa_profile.CONVERSIONS)
    try:
        conv = dsa_profile.TopkConversion("mine", lambda T, K, B: None, "a test conversion")
        dsa_profile.register_conversion("kvaddr", conv)
        assert dsa_profile.CONVERSIONS["kvaddr"] is conv
        with pytest.raises(ValueError, match="design must be one of"):
            dsa_profile.register_conversion("other", conv)
        with pytest.raises(TypeError, match="TopkConversion"):
            dsa_profile.register_conversion("kvaddr", lambda T, K, B: None)
    finally:
        dsa_profile.CONVERSIONS.clear()
        dsa_profile.CONVERSIONS.update(before)


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
