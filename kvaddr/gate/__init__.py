"""The regression gate: baseline files, the statistics of two sample sets, and the
comparison of two profiles into verdicts.

Layer: gate. May import the library, :mod:`kvaddr.strategies` and
:mod:`kvaddr.measure` (and the library-level :mod:`kvaddr.engines` and
:mod:`kvaddr.torch`); never :mod:`kvaddr.traces`, :mod:`kvaddr.commands` or
:mod:`kvaddr.cli`. Checked by tests/unit/test_layering.py.
"""
