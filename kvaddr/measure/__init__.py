"""Measurement: workloads, timing, the environment, correctness checks, the profile run,
its report, sweeps and plots, and the workload profiles (``profiles/*.toml``).

Layer: measurement. May import the library and :mod:`kvaddr.strategies`; never
:mod:`kvaddr.traces`, :mod:`kvaddr.gate`, :mod:`kvaddr.commands` or :mod:`kvaddr.cli`.
"""
