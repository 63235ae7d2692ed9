"""kvaddr.device on a real GPU: the check passes, a missing device ordinal is named."""

import pytest

from tests.support.gpu import requires_gpu


@requires_gpu
def test_require_cuda_passes_and_the_planner_builds():
    import cupy

    from kvaddr import StepPlanner
    from kvaddr.device import cuda_status, require_cuda

    n = cupy.cuda.runtime.getDeviceCount()
    assert require_cuda() == n and require_cuda(0) == n
    status = cuda_status()
    assert status.available and status.device_count == n and status.reason == f"{n} CUDA device(s)"
    assert StepPlanner(4, 8, [4]).device == cupy.cuda.runtime.getDevice()


@requires_gpu
def test_a_device_ordinal_that_does_not_exist_is_no_cuda_device():
    import cupy

    from kvaddr import KvaddrError, NoCudaDevice, StepPlanner
    from kvaddr.strategies.gpu import make_strategy

    n = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(NoCudaDevice, match=f"there is no CUDA device {n} \\(the CUDA runtime sees {n}"):
        StepPlanner(4, 8, [4], device=n)
    with pytest.raises(KvaddrError, match="kvaddr.strategies.cpu run on the CPU"):
        make_strategy("per-layer", max_requests=4, capacity=8, block_sizes=[4], device=n)
