"""The command-line commands, registered on the click group in :mod:`kvaddr.cli`.

Layer: commands. May import every other layer; nothing but :mod:`kvaddr.cli` imports it.
"""
