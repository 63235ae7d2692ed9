"""Fixtures of the unit tests."""

from tests.support.fake_cupy import fake_gpu  # noqa: F401  (a fixture: the fake CuPy of the GPU-flow tests)
from tests.support.torch_fakes import fake_cuda_launch  # noqa: F401  (a fixture: the torch ops' CUDA kernels on CPU tensors)
from tests.support.vllm_emulated_gpu import emulated_gpu  # noqa: F401  (a fixture: fake_gpu + the vLLM kernels emulated)
