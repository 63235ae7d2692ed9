"""The fused kernel's KvStepParams struct on the device (needs a GPU): the planner's
persistent-struct launch (cuLaunchKernel with a prebuilt kernelParams) and a bare
RawKernel launch of the same struct (``launch_args``: a CPointer to it, as
benchmarks/bench_step.py does) both match the NumPy reference, outputs and error
records, on random small- and large-batch steps with 0 to 4 caches and both
position dtypes. (The baseline strategies, launched by named argument structs, are
compared with the reference by test_gpu_strategies.py.)"""

import numpy as np
import pytest

from tests.support.gpu import assert_outputs_equal, poison, reference, requires_gpu, to_device
from tests.support.step_cases import random_step

pytestmark = requires_gpu


def _case(seed, bsz, num_caches, errors):
    rng = np.random.default_rng(seed)
    n = max(num_caches, 1)
    kw = {}
    if bsz > 1000:  # keep large batches' tokens and tables small: decode, speculative, idle
        kw = dict(mix=("decode", "spec", "idle"), block_sizes=[16, 64, 96, 256][:n])
    case = random_step(rng, bsz=bsz, num_caches=n, errors=errors, **kw)
    if num_caches == 0:  # a positions-only planner
        case["block_sizes"], case["block_tables"] = [], []
    return case


@pytest.mark.parametrize("position_dtype", [np.int64, np.int32])
@pytest.mark.parametrize(
    "seed, bsz, num_caches, errors",
    [
        (1, 1, 1, False),
        (2, 37, 2, False),
        (3, 64, 4, True),
        (4, 0, 1, False),
        (5, 300, 0, False),
        (6, 4096, 3, True),
        (7, 4097, 1, False),  # the large-batch (ticketed) path
        (8, 9000, 4, True),
        (9, 9000, 0, True),
    ],
)
def test_struct_launch_and_bare_rawkernel_launch_match_the_reference(position_dtype, seed, bsz, num_caches, errors):
    import cupy

    from kvaddr import StepPlanner, kernel_loader

    case = _case(seed, bsz, num_caches, errors)
    ref = reference(case, position_dtype=position_dtype)
    dev = to_device(case)
    planner = StepPlanner(max(bsz, 1), case["capacity"], case["block_sizes"], position_dtype=position_dtype)
    tables = dev["block_tables"] if num_caches else None
    label = f"seed {seed} bsz {bsz} caches {num_caches} {np.dtype(position_dtype).name}"

    poison(planner)
    out = planner.compute(dev["seq_lens_decoder"], dev["seq_lens_this_time"], tables)
    cupy.cuda.get_current_stream().synchronize()
    assert_outputs_equal(out, ref.outputs, f"{label}, planner launch")
    assert planner.errors() == (ref.error_mask, ref.error_key), f"{label}, planner error record"

    # The same struct through CuPy's RawKernel call (a CPointer to the struct).
    poison(planner)
    cupy.cuda.runtime.deviceSynchronize()
    got_bsz, args = planner.launch_args(dev["seq_lens_decoder"], dev["seq_lens_this_time"], tables)
    assert got_bsz == bsz and len(args) == 1
    name, blocks, threads = planner.kernel_for(bsz)  # the dispatch table's kernel for the batch
    raw = kernel_loader.get_function(name)
    raw((blocks,), (threads,), args, 0, kernel_loader.raw_stream(cupy.cuda.get_current_stream().ptr))
    cupy.cuda.runtime.deviceSynchronize()
    assert_outputs_equal(planner._outputs(bsz), ref.outputs, f"{label}, bare RawKernel launch")
    assert planner.errors() == (ref.error_mask, ref.error_key), f"{label}, bare launch error record"
