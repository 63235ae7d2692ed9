"""GPU checks shared by the attention kernels' test files: ``tests/gpu/test_attention_one_gpu.py``
(``step_small_attention``, up to 256 requests) and ``tests/gpu/test_attention_wide_gpu.py``
(``step_wide_attention``, 257 to 4096). Each check takes a ``make_planner(case)`` callable, so a
file keeps its own planner set-up and the checks stay the same for both kernels; ``family`` is the
kernel the planner must launch for the batch (its name up to the template arguments).

Every check compares the GPU's outputs and error record with the NumPy reference
(``kvaddr.reference.step_addressing``); cupy is imported inside the functions (the files skip
without a GPU before any of them runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tests.support import gpu
from tests.support.attention_cases import ALL_GROUPS, make_case
from tests.support.gpu import ATTENTION_BUFFERS, assert_attention_equal, assert_outputs_equal, poison, to_device

#: Every non-empty subset of the attention groups, in ATTENTION_GROUPS order.
GROUP_SUBSETS = [
    ("flashinfer",),
    ("varlen",),
    ("page_table",),
    ("flashinfer", "varlen"),
    ("flashinfer", "page_table"),
    ("varlen", "page_table"),
    ALL_GROUPS,
]


def reference(case: dict, groups: Sequence[str] = ALL_GROUPS):
    """The NumPy reference's step (outputs, error mask and key) for ``case`` with ``groups`` on."""
    return gpu.reference(case, attention=groups)


def family(kernel: str) -> str:
    """A kernel's name without its template arguments (``step_small_attention<1, int>``:
    ``step_small_attention``)."""
    return kernel.split("<", 1)[0]


def step_and_check(p, case: dict, groups: Sequence[str], label: str, *, kernel: str):
    """One ``compute()`` of ``case`` on planner ``p`` (whose kernel for the batch is of family
    ``kernel``): outputs, attention outputs and error record equal the reference's."""
    import cupy

    bsz = len(case["seq_lens_decoder"])
    assert family(p.kernel_for(bsz)[0]) == kernel, (label, p.kernel_for(bsz))
    dev = to_device(case)
    out = p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    cupy.cuda.get_current_stream().synchronize()
    ref = reference(case, groups)
    assert_attention_equal(out.attention, ref.outputs.attention, label)
    assert_outputs_equal(out, ref.outputs, f"{label}: addressing")
    assert p.errors() == (ref.error_mask, ref.error_key), f"{label}: error record"
    return out


def check_poisoned_buffers(make_planner: Callable, rng, shapes, *, kernel: str) -> None:
    """Every element of every attention buffer (the pad -1 included) is written on every call:
    buffers poisoned first, for each ``(bsz, block_sizes, spare_capacity)`` of ``shapes``."""
    import cupy

    for bsz, sizes, spare in shapes:
        case = make_case(rng, bsz=bsz, block_sizes=sizes, spare_capacity=spare)
        p = make_planner(case)
        for name in ATTENTION_BUFFERS:
            assert getattr(p, name) is not None, name
        poison(p)
        out = step_and_check(p, case, ALL_GROUPS, f"poisoned, bsz {bsz}", kernel=kernel)
        idx = cupy.asnumpy(out.attention.kv_indices)
        indptr = cupy.asnumpy(out.attention.kv_indptr)
        N = case["kv_indices_capacity"]
        for g in range(len(sizes)):
            tail = idx[g, min(int(indptr[g, -1]), N) :]
            assert (tail == -1).all(), f"bsz {bsz}: cache {g}'s pad"


def check_guard_words(make_planner: Callable, rng, bsz: int, spares, *, kernel: str) -> None:
    """One cache whose kv_indices the kernel writes into a wider buffer: entries past N keep their
    guard value, over capacity and not (``spares``: spare_capacity values; a large one makes
    several pad blocks)."""
    import cupy

    for spare in spares:
        case = make_case(rng, bsz=bsz, block_sizes=[4], spare_capacity=spare)
        p = make_planner(case)
        N = case["kv_indices_capacity"]
        wide = cupy.full(N + 64, 0x7A7A7A7A, np.int32)
        p._params.kv_indices = wide.data.ptr  # [N + 64]: the kernel may write [0, N) only
        dev = to_device(case)
        assert family(p.kernel_for(bsz)[0]) == kernel, p.kernel_for(bsz)
        p.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
        cupy.cuda.get_current_stream().synchronize()
        assert (cupy.asnumpy(wide[N:]) == 0x7A7A7A7A).all(), f"a write past N (spare {spare})"
        ref = reference(case)
        np.testing.assert_array_equal(cupy.asnumpy(wide[:N]), ref.outputs.attention.kv_indices[0])
        assert p.errors() == (ref.error_mask, ref.error_key), f"guard words, spare {spare}"


def check_graph_replay(make_planner: Callable, rng, bsz: int, sizes: list[int], *, kernel: str) -> None:
    """A CUDA graph of one compute() (a kernel of family ``kernel``), replayed after the inputs'
    contents change (a bad step between clean ones): every output and the error record follow."""
    import cupy

    cases = [make_case(rng, bsz=bsz, block_sizes=sizes, max_ctx=1000, spare_capacity=2) for _ in range(2)]
    cases.insert(1, make_case(rng, bsz=bsz, block_sizes=sizes, max_ctx=1000, bad="unallocated", spare_capacity=2))
    width = max(t.shape[1] for c in cases for t in c["block_tables"])
    cap = max(c["capacity"] for c in cases)
    N = max(c["kv_indices_capacity"] for c in cases)
    p = make_planner(dict(cases[0], capacity=cap, kv_indices_capacity=N))
    assert family(p.kernel_for(bsz)[0]) == kernel, p.kernel_for(bsz)
    d = cupy.zeros(bsz, np.int32)
    q = cupy.zeros(bsz, np.int32)
    tables = [cupy.full((bsz, width), -1, np.int32) for _ in sizes]
    cupy.cuda.runtime.deviceSynchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        p.compute(d, q, tables, stream=stream)
        stream.synchronize()
        p.clear_errors(stream)
        stream.begin_capture()
        p.compute(d, q, tables, stream=stream)
        graph = stream.end_capture()
    for i, c in enumerate(cases):
        host_tables = []
        for t in c["block_tables"]:
            full = np.full((bsz, width), -1, np.int32)
            full[:, : t.shape[1]] = t[:bsz]
            host_tables.append(full)
        c = dict(c, capacity=cap, kv_indices_capacity=N, block_tables=host_tables)
        ref = reference(c)
        with stream:
            d.set(c["seq_lens_decoder"], stream=stream)
            q.set(c["seq_lens_this_time"], stream=stream)
            for g, t in enumerate(host_tables):
                tables[g].set(t, stream=stream)
            graph.launch(stream)
        stream.synchronize()
        out = p._outputs(bsz)
        assert_attention_equal(out.attention, ref.outputs.attention, f"replay {i}")
        assert_outputs_equal(out, ref.outputs, f"replay {i}: addressing")
        assert p.errors(stream) == (ref.error_mask, ref.error_key), f"replay {i}: error record"


def check_bound_step(make_planner: Callable, big: dict, sizes_to_launch: Sequence[int]):
    """A BoundStep bound to ``big``'s arrays launches the kernel compute() would for each batch
    size of ``sizes_to_launch`` (a prefix of ``big``), with the reference's outputs and record.
    Returns the planner."""
    import cupy

    p = make_planner(big)
    dev = to_device(big)
    bound = p.bind(dev["seq_lens_decoder"], dev["seq_lens_this_time"], dev["block_tables"])
    for bsz in sizes_to_launch:
        args = bound.launch_args(bsz)
        assert (args[2], args[4]) == p.kernel_for(bsz)[1:], bsz
        out = bound.launch(bsz)
        cupy.cuda.get_current_stream().synchronize()
        case = dict(
            big,
            seq_lens_decoder=big["seq_lens_decoder"][:bsz],
            seq_lens_this_time=big["seq_lens_this_time"][:bsz],
            block_tables=[t[:bsz] for t in big["block_tables"]],
        )
        ref = reference(case)
        assert_attention_equal(out.attention, ref.outputs.attention, f"bound, bsz {bsz}")
        assert_outputs_equal(out, ref.outputs, f"bound, bsz {bsz}: addressing")
        assert p.errors() == (ref.error_mask, ref.error_key), f"bound, bsz {bsz}"
    return p
