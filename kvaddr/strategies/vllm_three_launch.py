"""vLLM's three-launch input preparation, re-implemented: the baseline of the vLLM step.

vLLM Model Runner V2 prepares a step's inputs in three kernel launches, in this
order and with these grids (docs/vllm.md; kvaddr's own CUDA, written from the
design, in the three-launch section of kernels.cu):

1. ``kvaddr_vllm3_prepare``, grid ``(num_reqs + 1,)``: a program per request
   (positions, seq_lens, DCP local length) plus one that pads;
2. ``kvaddr_vllm3_gather``, grid ``(rows, G)``: a program per batch row and group
   (the gathered block-table row);
3. ``kvaddr_vllm3_slots``, grid ``(num_reqs + 1, G)``: a program per request and
   group (slots from launch 1's positions) plus one per group that pads.

It writes the same outputs as :class:`~kvaddr.engines.vllm.VllmStepPlanner` (so
both are checked against the same reference) with the same stale-row zeroing, but
checks nothing (vLLM makes no checks): give it good inputs.
"""

from __future__ import annotations

from kvaddr import kernel_loader
from kvaddr.engines.vllm import THREADS_3, VllmStepOutputs, VllmStepPlanner
from kvaddr.validation import stream_handle


class VllmThreeLaunch(VllmStepPlanner):
    """The three-launch design with :class:`VllmStepPlanner`'s constructor and call."""

    kernel_name = "kvaddr_vllm3_prepare"

    def _load_functions(self) -> dict:
        return {
            name: kernel_loader.Launcher(
                kernel_loader.get_function(f"kvaddr_vllm3_{name}", self.device), self._params, by_value=True
            )
            for name in ("prepare", "gather", "slots")
        }

    @property
    def launches_per_step(self) -> int:
        return 3

    def compute(
        self,
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        block_tables,
        num_blocks,
        num_reqs_padded: int | None = None,
        *,
        stream=None,
    ) -> VllmStepOutputs:
        """Same arguments and outputs as :meth:`VllmStepPlanner.compute`, in three launches."""
        n, padded = self._prepare(
            idx_mapping, query_start_loc, num_computed_tokens, block_tables, num_blocks, num_reqs_padded
        )
        s = stream_handle(stream)
        G = self.config.num_groups
        # Rows to visit: the padded batch and every row the previous call filled (the
        # host knows it here; the one-launch step keeps it on the device).
        rows = max(padded, self._prev_rows, 1)
        self._fns["prepare"](n + 1, THREADS_3, s)
        self._fns["gather"](rows, THREADS_3, s, G)
        self._fns["slots"](n + 1, THREADS_3, s, G)
        self._prev_rows = n
        return self.outputs
