"""kvaddr's shared constants, in one place.

Library level: imports nothing of kvaddr, so every layer may use it.

``MAX_CACHES`` is ``KV_MAX_CACHES`` of ``kernels.cu`` (the kernels' own copy;
``tests/unit/test_constants.py`` checks that the two agree).
"""

from __future__ import annotations

#: Largest int32 value: the bound of every int32 length, offset and id.
INT32_MAX = (1 << 31) - 1
#: Smallest int32 value.
INT32_MIN = -(1 << 31)
#: Slot id written for padding tokens (and tokens with bad addresses).
PAD_SLOT_ID = -1
#: Paged caches one step may address (``KV_MAX_CACHES`` in kernels.cu).
MAX_CACHES = 4

#: The strategies of the spec, in report order.
STRATEGY_NAMES = ("per-layer", "per-layer-kernel", "hoisted", "one-block", "fused")
#: How many strategies a profile run measures.
NUM_STRATEGIES = len(STRATEGY_NAMES)
#: The most requests the one-block strategy runs (one block of one thread per request;
#: ``KV_ONE_BLOCK_MAX_REQUESTS`` in kernels.cu).
ONE_BLOCK_MAX_REQUESTS = 1024
#: Strategies that cannot run every batch: the most requests each runs in one step.
REQUEST_LIMITS = {"one-block": ONE_BLOCK_MAX_REQUESTS}
#: The strategy every saving is measured against (the per-layer chain).
SAVINGS_REFERENCE = "per-layer"
#: Name of the launch floor's row (one empty launch per step in the same mode).
FLOOR = "floor"

#: Launch modes of a GPU profile run.
MODES = ("eager", "graph")
#: The (mode, clock) measures, in report order.
MEASURES = (("graph", "gpu"), ("eager", "host"), ("eager", "gpu"))

#: Limits that keep one profiled or replayed step within memory.
MAX_CONTEXT = 1 << 30
MAX_TOKENS_PER_STEP = 1 << 24
MAX_TABLE_ENTRIES = 1 << 26
