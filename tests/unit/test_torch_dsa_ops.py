"""``torch.ops.kvaddr.dsa_topk_to_slots`` on the CPU: equal to the NumPy reference (the worked example,
random rows, layers, DCP, compaction), padding tokens, sticky error records, opcheck,
torch.compile(fullgraph=True) equal to eager with no graph break, and bad arguments naming the
argument. Skips without torch. tests/gpu/test_torch_dsa_ops_gpu.py runs the CUDA kernel."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.dsa_reference import ERR_PAST_CONTEXT, NO_ERROR_KEY, topk_error_key
from kvaddr.dsa_reference import topk_to_slots as reference
from tests.support.torch_ops import torch_skip_reason

SKIP = torch_skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

EX = ([[6, 1, 3, 5], [0, 1, 2, -1], [0, 1, 2, 3], [4, 0, 2, 3]], [0, 1, 1, 1], [[5, 2], [9, 3]], 4, [7, 3, 4, 5])


def t32(x):
    import torch

    return torch.tensor(np.asarray(x), dtype=torch.int32)


def random_case(seed, layers=1, t=23, k=19, b=5):
    rng = np.random.default_rng(seed)
    table = rng.integers(-1, 60, size=(4, 6))
    req = rng.integers(0, 4, size=t)
    ctx = rng.integers(0, 40, size=t)
    topk = rng.integers(-1, 40, size=(layers, t, k))
    return (topk if layers > 1 else topk[0]), req, table, b, ctx


def check(case, **kw):
    from kvaddr.torch import dsa_topk_to_slots

    topk, req, table, b, ctx = case
    out, counts, errors = dsa_topk_to_slots(t32(topk), t32(req), t32(table), b, t32(ctx), **kw)
    want = reference(topk, req, table, b, ctx, **kw)
    np.testing.assert_array_equal(out.numpy(), want.slots)
    np.testing.assert_array_equal(counts.numpy(), want.valid_counts)
    rec = errors.numpy().view(np.uint64)
    np.testing.assert_array_equal(rec[:, 0], np.atleast_1d(want.error_mask))
    np.testing.assert_array_equal(rec[:, 1], np.atleast_1d(np.asarray(want.error_key, np.uint64)))


@pytest.mark.parametrize("compact", [False, True])
def test_worked_example(compact):
    check(EX, compact=compact)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("compact", [False, True])
def test_random_rows(seed, layers, compact):
    check(random_case(seed, layers), compact=compact)
    check(random_case(seed + 10, layers), compact=compact, cp_size=3, cp_rank=seed % 3, cp_interleave=2)


def test_padding_tokens_and_sticky_records():
    import torch

    from kvaddr.torch import dsa_topk_to_slots
    from kvaddr.torch.dsa_ops import new_errors

    errors = new_errors(1)
    topk = t32([[9, 0], [5, 5]])
    out, counts, _ = dsa_topk_to_slots(topk, t32([0, -1]), t32([[3, 4, 5]]), 4, t32([9, 0]), errors=errors)
    dsa_topk_to_slots(topk, t32([0, -1]), t32([[3, 4, 5]]), 4, t32([10, 0]), errors=errors)
    assert out.tolist() == [[-1, 12], [-1, -1]] and counts.tolist() == [1, 0]
    rec = errors.numpy().view(np.uint64)
    assert int(rec[0, 0]) == ERR_PAST_CONTEXT and int(rec[0, 1]) == topk_error_key(0, 0, ERR_PAST_CONTEXT)
    assert errors.dtype == torch.int64 and new_errors(2).numpy().view(np.uint64)[1, 1] == NO_ERROR_KEY


def _op_args(layers=1):
    import torch

    from kvaddr.torch.dsa_ops import new_errors

    topk, req, table, b, ctx = random_case(3, layers)
    tk = t32(topk)
    return (
        tk,
        t32(req),
        t32(table),
        t32(ctx),
        b,
        True,
        1,
        0,
        1,
        torch.empty_like(tk),
        torch.empty(tk.shape[:-1], dtype=torch.int32),
        new_errors(layers),
    )


@pytest.mark.parametrize("layers", [1, 2])
def test_opcheck_passes(layers):
    import torch
    from torch.library import opcheck

    result = opcheck(torch.ops.kvaddr.dsa_topk_to_slots.default, _op_args(layers))
    assert all(v == "SUCCESS" for v in result.values()), result


def _model():
    import torch

    from kvaddr.torch import dsa_topk_to_slots

    def model(topk, req, table, ctx, scores):
        slots, counts, errors = dsa_topk_to_slots(topk, req, table, 5, ctx, compact=True)
        return (scores[slots.clamp(min=0) % scores.shape[0]] * (slots >= 0)).sum(-1) + counts, errors

    topk, req, table, _b, ctx = random_case(7)
    return model, (t32(topk), t32(req), t32(table), t32(ctx), torch.randn(64))


def test_no_graph_break():
    import torch

    model, args = _model()
    explained = torch._dynamo.explain(model)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_fullgraph_equals_eager(backend):
    import torch

    model, args = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got, want = compiled(*args), model(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "index, value, exc, name",
    [
        (0, "i64", TypeError, "topk"),
        (1, "long", ValueError, "req_id"),
        (3, "long", ValueError, "ctx"),
        (2, "1d", ValueError, "block_table"),
        (4, 0, ValueError, "block_size"),
        (9, "long", ValueError, "out"),
        (10, "long", ValueError, "counts"),
        (11, "long", ValueError, "errors"),
    ],
)
@pytest.mark.parametrize("fake", [False, True])
def test_bad_arguments_name_the_argument(index, value, exc, name, fake):
    import torch

    args = list(_op_args())
    if value == "i64":
        args[index] = args[index].to(torch.int64)
    elif value == "long":
        args[index] = torch.zeros((99,) + tuple(args[index].shape[1:]), dtype=args[index].dtype)
    elif value == "1d":
        args[index] = torch.zeros(4, dtype=torch.int32)
    else:
        args[index] = value
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(exc, match=name):
                torch.ops.kvaddr.dsa_topk_to_slots.default(*args)
    else:
        with pytest.raises(exc, match=name):
            torch.ops.kvaddr.dsa_topk_to_slots.default(*args)
