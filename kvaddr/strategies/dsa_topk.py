"""The top-k -> slot conversion of DeepSeek-V3.2's sparse attention, two ways, one interface.

* :class:`KvaddrTopkSlots`: :func:`kvaddr.dsa.topk_to_slots`, one launch for every layer given
  (checked: context, width, block id; valid counts; optionally compacted rows).
* :class:`BaselineTopkSlots`: the engines' design re-implemented (``kvaddr_dsa_topk_baseline``,
  kernels/baselines.cuh): one launch per layer, one program per token and 128 columns, no
  context check, no counts, no compaction. Give it valid input.

Both own persistent outputs sized for ``max_tokens`` tokens and ``num_layers`` layers and
return :class:`~kvaddr.dsa.TopkSlotOutputs` views of them (the baseline's ``valid_counts`` and
``errors`` are None). ``compute(topk, req_id, block_table, ctx, stream=None)`` takes a
``[T, K]`` or ``[L, T, K]`` int32 top-k (``T <= max_tokens``, ``L <= num_layers``): what the
profiler times per layer or per step.
"""

from __future__ import annotations

import numpy as np

from kvaddr import kernel_loader
from kvaddr.dsa import DsaTopkParams, TopkSlotOutputs, prepare_topk_to_slots
from kvaddr.dsa_reference import NO_ERROR_KEY
from kvaddr.validation import check_int, describe, memo_guard, stream_handle

__all__ = ["BaselineTopkSlots", "KvaddrTopkSlots", "TopkSlotStrategy"]

#: Columns per program of the engines' design (kernels/baselines.cuh's KV_DSA_BASELINE_COLUMNS).
BASELINE_COLUMNS = 128


class TopkSlotStrategy:
    """Persistent outputs and the common ``compute`` interface.

    Parameters
    ----------
    max_tokens : int
        The most tokens of a call (>= 1).
    k : int
        ``K``, entries per row (>= 1).
    block_size : int
        ``B`` (>= 1).
    num_layers : int, optional
        The most layers of one call (``[L, T, K]`` top-k).
    device : int, optional
        CUDA device (CuPy's current one by default).
    """

    name = ""

    def __init__(self, max_tokens: int, k: int, block_size: int, *, num_layers: int = 1, device: int | None = None):
        import cupy

        self.max_tokens = check_int("max_tokens", max_tokens, lo=1)
        self.k = check_int("k", k, lo=1)
        self.block_size = check_int("block_size", block_size, lo=1)
        self.num_layers = check_int("num_layers", num_layers, lo=1)
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        n = self.num_layers * self.max_tokens
        with cupy.cuda.Device(self.device):
            self._slots = cupy.empty((n * self.k,), dtype=np.int32)
            self._counts = cupy.empty((n,), dtype=np.int32)
            self.errors = cupy.empty((self.num_layers, 2), dtype=np.uint64)
            self.errors[:, 0] = 0
            self.errors[:, 1] = NO_ERROR_KEY
            # Cleared on CuPy's current stream; compute() may run on any other.
            cupy.cuda.get_current_stream().synchronize()

    def _shape(self, topk) -> tuple:
        info = describe("topk", topk)
        shape = tuple(info.shape)
        if len(shape) not in (2, 3):
            raise ValueError(f"topk must have shape [T, K] or [L, T, K], got {shape}")
        layers, t, k = (1, *shape) if len(shape) == 2 else shape
        if k != self.k or t > self.max_tokens or layers > self.num_layers:
            raise ValueError(
                f"topk must have shape [T <= {self.max_tokens}, {self.k}] or [L <= {self.num_layers}, T, {self.k}],"
                f" got {shape}"
            )
        return shape, layers, t

    def compute(self, topk, req_id, block_table, ctx, *, stream=None) -> TopkSlotOutputs:
        raise NotImplementedError


class KvaddrTopkSlots(TopkSlotStrategy):
    """kvaddr's conversion (:func:`kvaddr.dsa.topk_to_slots`) into persistent outputs.

    Parameters
    ----------
    max_tokens, k, block_size, num_layers, device
        As :class:`TopkSlotStrategy`.
    compact : bool, optional
        Valid slots first in each row.
    cp_size, cp_rank, cp_interleave : int, optional
        Decode context parallelism (docs/dsa.md).
    """

    def __init__(
        self,
        max_tokens: int,
        k: int,
        block_size: int,
        *,
        num_layers: int = 1,
        compact: bool = False,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        device: int | None = None,
    ):
        super().__init__(max_tokens, k, block_size, num_layers=num_layers, device=device)
        self.compact = compact
        self.name = "kvaddr compact" if compact else "kvaddr"
        self._dcp = {"cp_size": cp_size, "cp_rank": cp_rank, "cp_interleave": cp_interleave}
        self._same = None
        self._launch = None

    def compute(self, topk, req_id, block_table, ctx, *, stream=None) -> TopkSlotOutputs:
        """The slots, valid counts and (sticky) error records of ``topk``, in one launch.

        The same array objects as the call before, unchanged (memory, shape, strides), skip the
        checks: the checked launch is run again.
        """
        same = self._same
        if same is not None and same(topk, req_id, block_table, ctx):
            return self._launch.launch(stream)
        shape, layers, t = self._shape(topk)
        self._launch = prepare_topk_to_slots(
            topk,
            req_id,
            block_table,
            self.block_size,
            ctx,
            out=self._slots[: layers * t * self.k].reshape(shape),
            counts=self._counts[: layers * t].reshape(shape[:-1]),
            errors=self.errors[:layers],
            compact=self.compact,
            **self._dcp,
        )
        self._same = memo_guard((topk, req_id, block_table, ctx))
        return self._launch.launch(stream)


class BaselineTopkSlots(TopkSlotStrategy):
    """The engines' conversion: per layer, one program per token and 128 columns, no checks."""

    name = "baseline"

    def __init__(self, max_tokens: int, k: int, block_size: int, *, num_layers: int = 1, device: int | None = None):
        super().__init__(max_tokens, k, block_size, num_layers=num_layers, device=device)
        self._params = DsaTopkParams()
        self._launch = kernel_loader.Launcher(
            kernel_loader.get_function("kvaddr_dsa_topk_baseline", self.device), self._params, by_value=True
        )

    def compute(self, topk, req_id, block_table, ctx, *, stream=None) -> TopkSlotOutputs:
        """The slots of ``topk`` (``valid_counts`` and ``errors`` None), one launch per layer."""
        shape, layers, t = self._shape(topk)
        out = self._slots[: layers * t * self.k].reshape(shape)
        ti, oi = describe("topk", topk), describe("out", out)
        ri, bi = describe("req_id", req_id), describe("block_table", block_table)
        p = self._params
        p.req_id, p.block_table, p.table_stride = ri.ptr, bi.ptr, bi.strides[0]
        p.width, p.block_size, p.k, p.num_tokens, p.num_layers = bi.shape[1], self.block_size, self.k, t, 1
        s = stream_handle(stream)
        grid_y = -(-self.k // BASELINE_COLUMNS)
        step = t * self.k * 4
        for layer in range(layers):
            p.topk, p.slots = ti.ptr + layer * step, oi.ptr + layer * step
            if t:
                self._launch(t, BASELINE_COLUMNS, s, grid_y)
        return TopkSlotOutputs(out, None, None)
