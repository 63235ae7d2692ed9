"""``torch.ops.kvaddr.vllm_draft_into`` on the CPU (the NumPy reference into the packed views):
outputs equal to the reference's, argument checks naming the argument, ``opcheck`` and
``torch.compile(fullgraph=True)``. The CUDA kernel behind the same op: tests/gpu/test_vllm_draft_gpu.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import skips

torch = pytest.importorskip("torch")

from kvaddr.torch import VllmDraftBuffers, vllm_draft  # noqa: E402
from tests.support.draft_cases import draft_case, reference  # noqa: E402


def _case(seed=0, **kw):
    case = draft_case(np.random.default_rng(seed), num_reqs=5, max_num_reqs=7, attention="flashinfer,varlen", **kw)
    s = dict(case["settings"])
    s["attention"] = "flashinfer,varlen"
    return case, s


def _args(case):
    x = case["inputs"]
    t = torch.from_numpy
    return (
        t(x["idx_mapping"]),
        t(x["query_start_loc"]),
        t(x["seq_lens"]),
        t(x["num_rejected"]),
        t(x["num_sampled"]),
        [t(a) for a in x["block_tables"]],
        t(np.stack(x["num_blocks"])),
        t(x["verify_slot_mappings"]),
    )


def test_cpu_op_equals_reference():
    case, s = _case()
    buf = VllmDraftBuffers(**s, device="cpu")
    out = vllm_draft(*_args(case), buf)
    want = reference(case)
    for name, v in out.items():
        w = getattr(want, name) if name != "first_slot_mappings" else want.first_slot_mappings
        got = v.numpy()
        if name == "first_slot_mappings":
            got = got[:, : w.shape[1]]
        assert np.array_equal(got, w), name
    assert buf.errors() == (want.error_mask, want.error_key)


def test_cpu_op_records_errors():
    case, s = _case(1, prefill_share=0.0, dummy_share=0.0)
    case["inputs"]["num_rejected"][1] = 50
    buf = VllmDraftBuffers(**s, device="cpu")
    vllm_draft(*_args(case), buf)
    with pytest.raises(Exception, match="num_rejected"):
        buf.check()


def test_checks_name_the_argument():
    case, s = _case()
    buf = VllmDraftBuffers(**s, device="cpu")
    args = list(_args(case))
    args[2] = args[2].to(torch.int64)
    with pytest.raises(TypeError, match="seq_lens"):
        vllm_draft(*args, buf)
    args = list(_args(case))
    args[7] = args[7][:, :0].to(torch.int32)
    with pytest.raises(ValueError, match="verify_slot_mappings"):
        vllm_draft(*args, buf)


def test_opcheck():
    case, s = _case()
    buf = VllmDraftBuffers(**s, device="cpu")
    a = _args(case)
    torch.library.opcheck(torch.ops.kvaddr.vllm_draft_into.default, (*a, buf.storage, buf.layout))


def test_views_see_torch_dtypes_and_python_ints_only():
    """views() runs inside torch.compile: a NumPy dtype there is a dict key Dynamo cannot hash on
    some torch versions (NumpyDTypeVariable), so the packing it reads holds none."""
    _, s = _case()
    buf = VllmDraftBuffers(**s, device="cpu")

    def plain(x):
        if isinstance(x, (tuple, list)):
            return all(plain(y) for y in x)
        return isinstance(x, (str, int, torch.dtype)) and not isinstance(x, np.generic)

    assert plain(buf._layout.fields), buf._layout.fields


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        pytest.param(
            "inductor",
            marks=pytest.mark.skipif(os.environ.get("KVADDR_TEST_INDUCTOR") != "1", reason=skips.INDUCTOR_OPT_IN),
        ),
    ],
)
def test_compile_fullgraph(backend):
    """The path of vllm_draft under compilation (the views of the packed storage), every field."""
    case, s = _case()
    buf = VllmDraftBuffers(**s, device="cpu")
    a = _args(case)
    vllm_draft(*a, buf)

    def f(*xs):
        o = vllm_draft(*xs, buf)
        return {k: v + 0 for k, v in o.items()}

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend)(*a)
    want = reference(case)
    assert set(got) == set(buf.outputs)
    for name in ("positions", "slot_mappings", "kv_indices", "cu_seqlens_k", "last_token_indices"):
        assert np.array_equal(got[name].numpy(), getattr(want, name)), name
