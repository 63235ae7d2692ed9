"""Measurement: workloads, timing, the environment, correctness checks, the profile run,
its report, sweeps and plots, and the workload profiles (``profiles/*.toml``).

Layer: measurement. May import the library, :mod:`kvaddr.strategies` and the
library-level :mod:`kvaddr.engines` and :mod:`kvaddr.torch`; never :mod:`kvaddr.traces`,
:mod:`kvaddr.gate`, :mod:`kvaddr.commands` or :mod:`kvaddr.cli`. Checked by
tests/unit/test_layering.py.
"""
