"""vLLM's per-draft-step preparation, re-implemented: the baseline of the one-launch draft addressing.

vLLM Model Runner V2's speculator prepares each draft forward separately (docs/spec-decode.md;
kvaddr's own CUDA, written from the design, in the per-step section of kernels/spec.cuh):

1. ``kvaddr_draft_first``: the sampled rows (``last_token_indices``), and with ``mask_rejected``
   the first forward's slot mappings;
2. for each draft step j = 1 .. k-1:

   * ``kvaddr_draft_prepare``: the step's positions, ``seq_lens``, DCP local lengths and
     ``query_start_loc`` (a thread per batch row);
   * ``kvaddr_draft_slots``, grid ``(rows, G)``: every group's slot mapping from those positions;
   * with attention metadata, ``kvaddr_draft_meta`` once per group (vLLM builds it on the host;
     one kernel per group is the cheaper stand-in).

``1 + (k - 1) * (2 + G)`` launches with attention metadata (``1 + 2 (k - 1)`` without), where the
planner makes one. It writes the same outputs as
:class:`~kvaddr.engines.vllm_draft.VllmDraftPlanner` (so both are checked against the same
reference) and checks nothing (vLLM makes no checks): give it good inputs.
"""

from __future__ import annotations

from kvaddr import kernel_loader
from kvaddr.engines.vllm_draft import VllmDraftOutputs, VllmDraftPlanner

#: Threads per block of the per-row baseline kernels (VDRAFT3_THREADS).
THREADS_3 = 128
#: Threads of the metadata kernel (VDRAFT_THREADS).
META_THREADS = 256


class VllmDraftPerStep(VllmDraftPlanner):
    """The per-draft-step design with :class:`VllmDraftPlanner`'s constructor and call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        p = self._params
        self._fns = {
            name: kernel_loader.Launcher(
                kernel_loader.get_function(f"kvaddr_draft_{name}", self.device), p, by_value=True
            )
            for name in ("first", "prepare", "slots", "meta")
        }
        M, T, G = self.config.max_num_reqs, self.config.max_num_batched_tokens, self.config.num_groups
        self._grids = {
            "first": -(-(M + (T if self.mask_rejected else 0)) // THREADS_3),
            "prepare": -(-(M + 1) // THREADS_3),
            "slots": max(-(-M // THREADS_3), 1),
        }
        self._groups = G

    @property
    def launches_per_cycle(self) -> int:
        """Launches of one call (the planner makes one)."""
        S = self.num_speculative_steps - 1
        return 1 + S * (2 + (self._groups if self._attn_bits else 0))

    def bind(self, *args, **kwargs):
        raise TypeError("bind needs the one-launch VllmDraftPlanner, not VllmDraftPerStep")

    def compute(
        self,
        idx_mapping,
        query_start_loc,
        seq_lens,
        num_rejected,
        num_sampled,
        block_tables,
        num_blocks=None,
        verify_slot_mappings=None,
        *,
        stream=None,
    ) -> VllmDraftOutputs:
        """Same arguments and outputs as :meth:`VllmDraftPlanner.compute`, in one launch per kernel
        and draft step."""
        from kvaddr.engines.vllm import check_batch
        from kvaddr.engines.vllm_config import INT64

        stream = self._stream(stream)
        idx, qsl = check_batch(idx_mapping, query_start_loc, self.config.max_num_reqs, self.device)
        n = idx.shape[0]
        f = self._check_state((seq_lens, num_rejected, num_sampled), n, block_tables, num_blocks, verify_slot_mappings)
        P = self._params
        self._write(P, f)
        P.idx_mapping, P.num_reqs, P.idx_is_64, P.query_start_loc = idx.ptr, n, int(idx.dtype == INT64), qsl.ptr
        fns, grids = self._fns, self._grids
        fns["first"](grids["first"], THREADS_3, stream)
        for j in range(1, self.num_speculative_steps):
            P.base_step = j  # (the driver copies the parameter block at each launch)
            fns["prepare"](grids["prepare"], THREADS_3, stream)
            fns["slots"](grids["slots"], THREADS_3, stream, self._groups)
            if self._attn_bits:
                for g in range(self._groups):
                    P.base_group = g
                    fns["meta"](P.meta_chunks, META_THREADS, stream)
        return self.outputs
