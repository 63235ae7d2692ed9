"""The command-line commands, registered on the click group in :mod:`kvaddr.cli`.

One module per command family: :mod:`~kvaddr.commands.profile` (``profile``, ``info``),
:mod:`~kvaddr.commands.gate` (``compare``, ``check``), :mod:`~kvaddr.commands.traces`
(``trace generate``, ``replay``, ``sweep``, ``profiles``), all sharing
:mod:`~kvaddr.commands.common` (consoles, exit codes, option types and shared options).

Layer: commands. May import every other layer but :mod:`kvaddr.cli` (never imports it);
nothing but :mod:`kvaddr.cli` imports it. Checked by tests/unit/test_layering.py.
"""
