"""The four strategies of the spec: names, launches per step, where they come from."""

from kvaddr.constants import STRATEGY_NAMES

__all__ = ["CHAIN_OPS", "DESCRIPTIONS", "STRATEGY_NAMES", "check_name"]

#: Framework ops of the per-layer chain, one launch each (see strategies.py).
CHAIN_OPS = (
    "pos // B",
    "batch * row_stride",
    "+ block index",
    "clip to the table",
    "gather from the table",
    "pos % B",
    "block * B (int64)",
    "+ pos % B",
    "where(padding or bad, -1)",
)

DESCRIPTIONS = {
    "per-layer": "position kernel, then per layer and cache the framework-op chain (FastDeploy before #7367)",
    "per-layer-kernel": "position kernel, then one slot kernel per layer and cache",
    "hoisted": "position kernel and one op chain per distinct (table, B), shared by all layers (FastDeploy #7367)",
    "fused": "one launch for every output of the step (kvaddr)",
}


def check_name(name: str) -> str:
    if name not in STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGY_NAMES)}, got {name!r}")
    return name
