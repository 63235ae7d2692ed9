"""Serving traces: the JSON Lines format, the simulated-server generator, replay and its
report.

Layer: traces. May import the library, :mod:`kvaddr.strategies` and
:mod:`kvaddr.measure` (and the library-level :mod:`kvaddr.engines` and
:mod:`kvaddr.torch`); never :mod:`kvaddr.gate`, :mod:`kvaddr.commands` or
:mod:`kvaddr.cli`. Checked by tests/unit/test_layering.py.
"""
