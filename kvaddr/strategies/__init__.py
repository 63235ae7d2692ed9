"""The strategies kvaddr compares: per-layer, per-layer-kernel, hoisted, one-block and fused.

Holds :mod:`~kvaddr.strategies.names` (names, descriptions, launch counts, limits),
:mod:`~kvaddr.strategies.gpu` (all on the GPU, CuPy) and
:mod:`~kvaddr.strategies.cpu` (the same in NumPy, the CPU path).

Layer: strategies. May import the library (the top of :mod:`kvaddr`) and the
library-level :mod:`kvaddr.engines` and :mod:`kvaddr.torch`; never the measurement,
traces, gate or commands subpackages, nor :mod:`kvaddr.cli`. Checked by
tests/unit/test_layering.py.
"""
