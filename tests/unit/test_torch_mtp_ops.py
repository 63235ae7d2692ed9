"""torch.ops.kvaddr.draft_steps on the CPU: the NumPy reference substep by substep, opcheck,
torch.compile(fullgraph=True), argument checks. Skips without torch. tests/gpu/test_mtp_gpu.py
runs the CUDA kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.errors import NO_ERROR_KEY
from kvaddr.reference import step_addressing
from kvaddr.spec_reference import mtp_substep_lengths
from tests.support.torch_ops import torch_skip_reason

SKIP = torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _inputs(seed, bsz=9, k=3, sizes=(4, 3), bad=False):
    import torch

    rng = np.random.default_rng(seed)
    dec = rng.integers(0, 40, bsz).astype(np.int32)
    acc = rng.integers(0, k + 1, bsz).astype(np.int32)
    tables = [rng.integers(0, 1000, (bsz + 1, -(-(40 + 2 * k + 2) // B))).astype(np.int32) for B in sizes]
    if bad:
        dec[0], tables[0][1, :] = -1, -1
    return dec, acc, tables, (torch.from_numpy(dec), torch.from_numpy(acc), [torch.from_numpy(t) for t in tables])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bad", [False, True])
def test_cpu_op_equals_the_reference(seed, bad):
    import torch

    import kvaddr.torch as kt

    k, sizes = 3, [4, 3]
    dec, acc, tables, (td, ta, tt) = _inputs(seed, bad=bad)
    C = int(np.maximum(acc, 0).sum()) + 3
    buf = kt.DraftStepBuffers(16, C, sizes, k, position_dtype=torch.int32, device="cpu")
    out = kt.draft_steps(td, ta, tt, buf)
    mask, key = 0, NO_ERROR_KEY
    for j in range(k):
        dj, qj = mtp_substep_lengths(dec, acc, j)
        ref = step_addressing(dj, qj, tables, sizes, C, position_dtype=np.int32)
        mask, key = mask | ref.error_mask, min(key, ref.error_key)
        for f, want in ref.outputs.as_dict().items():
            np.testing.assert_array_equal(getattr(out.substep(j), f).numpy(), want, err_msg=f"{j} {f}")
    assert kt.draft_errors(buf) == (mask, key)
    assert (mask != 0) == bad
    assert kt.draft_errors(buf) == (0, NO_ERROR_KEY)  # read, then cleared


def test_opcheck_and_compile_fullgraph():
    import torch
    from torch.library import opcheck

    import kvaddr.torch as kt

    _, _, _, (td, ta, tt) = _inputs(5)
    buf = kt.DraftStepBuffers(16, 40, [4, 3], 3, device="cpu")
    result = opcheck(torch.ops.kvaddr.draft_steps.default, (td, ta, tt, [4, 3], *buf.outputs_args))
    assert all(v == "SUCCESS" for v in result.values()), result

    def model(d, a, t0, t1):
        o = kt.draft_steps(d, a, [t0, t1], buf)
        return o.slot_mapping.clone(), o.position_ids.clone()

    want = [x.clone() for x in model(td, ta, *tt)]
    got = torch.compile(model, fullgraph=True, backend="eager")(td, ta, *tt)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_argument_checks_name_the_argument():
    import torch

    import kvaddr.torch as kt

    _, _, _, (td, ta, tt) = _inputs(1)
    buf = kt.DraftStepBuffers(16, 40, [4, 3], 3, device="cpu")
    with pytest.raises(TypeError, match="accept_num"):
        kt.draft_steps(td, ta.long(), tt, buf)
    with pytest.raises(ValueError, match="accept_num"):
        kt.draft_steps(td, ta[:3], tt, buf)
    with pytest.raises(ValueError, match="block_tables"):
        kt.draft_steps(td, ta, [t[:2] for t in tt], buf)
    small = kt.DraftStepBuffers(4, 40, [4, 3], 3, device="cpu")
    with pytest.raises(ValueError, match="seq_lens_kv"):
        kt.draft_steps(td, ta, tt, small)
    with pytest.raises(ValueError, match="draft_steps"):
        kt.DraftStepBuffers(4, 40, [4], 0, device="cpu")
    args = list(buf.outputs_args)
    args[6] = torch.zeros((3, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="error_records"):
        torch.ops.kvaddr.draft_steps(td, ta, tt, [4, 3], *args)
