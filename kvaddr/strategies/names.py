"""The strategies of the spec: names, launches per step, where they come from, limits."""

from kvaddr.constants import ONE_BLOCK_MAX_REQUESTS, REQUEST_LIMITS, STRATEGY_NAMES
from kvaddr.errors import StrategyLimitExceeded

__all__ = [
    "CHAIN_OPS",
    "DESCRIPTIONS",
    "LAUNCHES",
    "ONE_BLOCK_MAX_REQUESTS",
    "ONE_BLOCK_WHY",
    "REQUEST_LIMITS",
    "STRATEGY_NAMES",
    "check_bsz",
    "check_name",
    "not_run_reason",
]

#: Framework ops of the per-layer chain, one launch each (kvaddr/strategies/gpu.py and cpu.py run them).
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
    "per-layer": "position kernel, then per layer and cache the framework-op chain (FastDeploy before PR #7367)",
    "per-layer-kernel": "position kernel, then one slot kernel per layer and cache",
    "hoisted": "position kernel and one op chain per distinct (table, B), shared by all layers (FastDeploy PR #7367)",
    "one-block": "one launch of one block, a thread per request adding up the earlier lengths, then looping over"
    " its tokens (FastDeploy after PR #7367; at most 1024 requests)",
    "fused": "one launch for every output of the step (kvaddr)",
}


def check_name(name: str) -> str:
    if name not in STRATEGY_NAMES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGY_NAMES)}, got {name!r}")
    return name


#: Launches per step (L layers, G caches, D distinct (table, B) pairs), as the spec's table states them.
LAUNCHES = {
    "per-layer": "1 + 9 L G",
    "per-layer-kernel": "1 + L G",
    "hoisted": "1 + 9 D (+ copies)",
    "one-block": "1",
    "fused": "1",
}

#: Why one-block has a request limit (its launch is one block of one thread per request).
ONE_BLOCK_WHY = "one block of one thread per request"


def not_run_reason(name: str, bsz: int) -> str | None:
    """Why strategy ``name`` cannot run a step of ``bsz`` requests (None when it can).

    The profiler and the trace replayer show this text instead of a time.
    """
    limit = REQUEST_LIMITS.get(name)
    if limit is None or bsz <= limit:
        return None
    return f"not run: {name} runs at most {limit} requests"


def check_bsz(name: str, bsz: int) -> int:
    """``bsz`` if strategy ``name`` can run it; else :class:`~kvaddr.errors.StrategyLimitExceeded`."""
    limit = REQUEST_LIMITS.get(name)
    if limit is not None and bsz > limit:
        raise StrategyLimitExceeded(name, limit, bsz, ONE_BLOCK_WHY if name == "one-block" else "")
    return bsz
