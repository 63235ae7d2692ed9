"""kvaddr: a whole decode step's KV-cache addressing in one kernel launch.

Public API
----------
StepPlanner        the fused step (one launch, CUDA-graph safe), :mod:`kvaddr.planner`
StepOutputs, PAD_SLOT_ID, AddressingError, KvaddrError, KernelCompileError, STRATEGY_NAMES
AttentionOutputs, PAD_PAGE_ID   the opt-in attention metadata (docs/attention.md)
NoCudaDevice       raised by StepPlanner and the GPU strategies without CuPy, a driver or a GPU
StrategyLimitExceeded  a step larger than a strategy runs (one-block: at most 1024 requests)

Modules imported by name (not attributes of ``kvaddr``):
:mod:`kvaddr.reference` (the NumPy reference, the oracle), :mod:`kvaddr.strategies.gpu` and
:mod:`kvaddr.strategies.cpu` (the strategies on the GPU and, in NumPy, on the CPU),
:mod:`kvaddr.engines.vllm` (the vLLM step) and :mod:`kvaddr.torch` (the PyTorch ops).
docs/api.md lists every public name.

The contract is stated in docs/spec.md.

Layers (imports flow one way; tests/unit/test_layering.py checks it): the library
(the modules at the top of :mod:`kvaddr`: constants, errors, outputs, validation,
reference, kernel_loader, planner) imports nothing of the subpackages; the
library-level :mod:`kvaddr.engines` (engine adapters) and :mod:`kvaddr.torch`
(PyTorch ops, may use engines) import only the library; then strategies <-
measure <- traces, gate <- commands <- cli.
"""

from typing import Any

from kvaddr.constants import STRATEGY_NAMES
from kvaddr.device import NoCudaDevice
from kvaddr.errors import AddressingError, KernelCompileError, KvaddrError, StrategyLimitExceeded
from kvaddr.outputs import PAD_PAGE_ID, PAD_SLOT_ID, AttentionOutputs, StepOutputs

__version__ = "0.2.0"

__all__ = [
    "PAD_PAGE_ID",
    "PAD_SLOT_ID",
    "STRATEGY_NAMES",
    "AddressingError",
    "AttentionOutputs",
    "KernelCompileError",
    "KvaddrError",
    "NoCudaDevice",
    "StepOutputs",
    "StepPlanner",
    "StrategyLimitExceeded",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # StepPlanner imports nothing of CuPy until it is built; keep `import kvaddr`
    # cheap and CuPy-free for the CPU path.
    if name == "StepPlanner":
        from kvaddr.planner import StepPlanner

        return StepPlanner
    raise AttributeError(f"module 'kvaddr' has no attribute {name!r}")
