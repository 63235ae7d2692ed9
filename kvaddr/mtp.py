"""The MTP substeps of a :class:`~kvaddr.planner.StepPlanner` built with ``draft_steps=k``.

After a verify step, FastDeploy's MTP draft model runs k substeps: substep 0 over the accepted
tokens (``seq_lens_this_time = accept_num``) from ``seq_lens_decoder`` (already rolled back by
the rejected drafts), substep j >= 1 one token per request with ``accept_num > 0`` over
``seq_lens_decoder + accept_num + j - 1`` (:func:`kvaddr.spec_reference.mtp_substep_lengths`).
One launch (kvaddr/kernels/mtp.cuh) writes every substep's core-step outputs into buffers
with a leading ``[k]`` dimension; substep j's slice equals what
:meth:`~kvaddr.planner.StepPlanner.compute` returns for substep j's lengths.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvaddr import dispatch, kernel_loader
from kvaddr.outputs import PAD_PAGE_ID, AttentionOutputs, StepOutputs
from kvaddr.validation import check_info, describe, stream_handle, write_tables

__all__ = ["BoundDraftSteps", "DraftOutputs"]


@dataclass
class DraftOutputs(StepOutputs):
    """Every MTP substep's outputs: :class:`~kvaddr.outputs.StepOutputs` fields with a leading
    ``[k]`` dimension (``cu_seqlens_q`` ``[k, bsz + 1]``, ``num_tokens`` ``[k]``,
    ``batch_id_per_token`` / ``position_ids`` ``[k, C]``, ``seq_lens_kv`` ``[k, bsz]``,
    ``slot_mapping`` ``[k, num_caches, C]``; the attention fields likewise, ``page_table`` the
    same rows for every substep). :meth:`substep` gives one substep's
    :class:`~kvaddr.outputs.StepOutputs` (views, no copy)."""

    def substep(self, j: int) -> StepOutputs:
        """Substep ``j``'s outputs, shaped as :meth:`~kvaddr.planner.StepPlanner.compute`'s."""
        a = self.attention
        att = None
        if a is not None:
            att = AttentionOutputs(page_table=a.page_table)
            for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k", "seqused_k"):
                v = getattr(a, name)
                setattr(att, name, None if v is None else v[j])
            if a.max_seqlen_q is not None:
                att.max_seqlen_q, att.max_seqlen_k = a.max_seqlen_q[j], a.max_seqlen_k[j]
        return StepOutputs(
            cu_seqlens_q=self.cu_seqlens_q[j],
            num_tokens=self.num_tokens[j],
            batch_id_per_token=self.batch_id_per_token[j],
            position_ids=self.position_ids[j],
            seq_lens_kv=self.seq_lens_kv[j],
            slot_mapping=self.slot_mapping[j],
            attention=att,
        )


class DraftPlan:
    """The planner's MTP buffers, parameter struct and launcher (built by StepPlanner)."""

    def __init__(self, planner, cupy, k: int, functions: dict) -> None:
        self.k = k
        pl = planner
        M, C, G = pl.max_requests, pl.capacity, pl.num_caches
        launch = dispatch.mtp_launch(pl.config)
        self.blocks, self.threads = launch.blocks, launch.threads
        self.cu_seqlens_q = cupy.zeros((k, M + 1), dtype=np.int32)
        self.num_tokens = cupy.zeros(k, dtype=np.int32)
        self.batch_id_per_token = cupy.full((k, C), -1, dtype=np.int32)
        self.position_ids = cupy.zeros((k, C), dtype=pl.position_dtype)
        self.seq_lens_kv = cupy.zeros((k, M), dtype=np.int32)
        self.slot_mapping = cupy.full((k, G, C), -1, dtype=np.int64)
        groups = pl.attention
        fi = "flashinfer" in groups
        S = M + 1  # the attention rows' stride, as the step's
        self.kv_indptr = self.kv_indices = self.kv_last_page_len = None
        self.cu_seqlens_k = self.max_seqlen = None
        if fi:
            self.kv_indptr = cupy.zeros((k, G, S), dtype=np.int32)
            self.kv_indices = cupy.full((k, G, pl.kv_indices_capacity), PAD_PAGE_ID, dtype=np.int32)
            self.kv_last_page_len = cupy.zeros((k, G, S), dtype=np.int32)
        if "varlen" in groups:
            self.cu_seqlens_k = cupy.zeros((k, M + 1), dtype=np.int32)
            self.max_seqlen = cupy.zeros((k, 2), dtype=np.int32)
        ptr = lambda a: 0 if a is None else a.data.ptr  # noqa: E731
        P = self.params = kernel_loader.MtpParams()
        # Everything but the inputs is the planner's step struct (block sizes, capacity, caches,
        # error records, attention flags); the outputs point at substep 0's rows.
        ctypes.memmove(ctypes.addressof(P.step), ctypes.addressof(pl._params), ctypes.sizeof(P.step))
        s = P.step
        s.seq_lens_this_time = 0  # unused: accept_num replaces it
        s.cu_seqlens_q = self.cu_seqlens_q.data.ptr  # [k, M + 1], int32
        s.num_tokens = self.num_tokens.data.ptr  # [k], int32
        s.batch_id_per_token = self.batch_id_per_token.data.ptr  # [k, C], int32
        s.position_ids = self.position_ids.data.ptr  # [k, C], int64 / int32
        s.seq_lens_kv = self.seq_lens_kv.data.ptr  # [k, M], int32
        s.slot_mapping = self.slot_mapping.data.ptr  # [k, G, C], int64
        s.kv_indptr = ptr(self.kv_indptr)  # [k, G, M + 1], int32
        s.kv_indices = ptr(self.kv_indices)  # [k, G, N], int32
        s.kv_last_page_len = ptr(self.kv_last_page_len)  # [k, G, M + 1], int32
        s.cu_seqlens_k = ptr(self.cu_seqlens_k)  # [k, M + 1], int32
        s.max_seqlen = ptr(self.max_seqlen)  # [k, 2], int32
        s.attn_stride = S  # int32
        P.num_substeps = k  # int32
        P.max_requests = M  # int32
        self.launcher = kernel_loader.Launcher(functions[launch.kernel], P, by_value=True)
        self._views: dict = {}
        self.last_args: tuple = ()  # the last call's inputs (kept alive, as compute() keeps its own)

    def outputs(self, bsz: int, page_table) -> DraftOutputs:
        out = self._views.get(bsz)
        if out is None:
            att = None
            if self.cu_seqlens_k is not None or self.kv_indptr is not None or page_table is not None:
                att = AttentionOutputs()
                if self.kv_indptr is not None:
                    att.qo_indptr = self.cu_seqlens_q[:, : bsz + 1]
                    att.kv_indptr = self.kv_indptr[:, :, : bsz + 1]
                    att.kv_indices = self.kv_indices
                    att.kv_last_page_len = self.kv_last_page_len[:, :, :bsz]
                if self.cu_seqlens_k is not None:
                    att.cu_seqlens_k = self.cu_seqlens_k[:, : bsz + 1]
                    att.seqused_k = self.seq_lens_kv[:, :bsz]
                    att.max_seqlen_q = self.max_seqlen[:, 0]
                    att.max_seqlen_k = self.max_seqlen[:, 1]
            out = self._views[bsz] = DraftOutputs(
                cu_seqlens_q=self.cu_seqlens_q[:, : bsz + 1],
                num_tokens=self.num_tokens,
                batch_id_per_token=self.batch_id_per_token,
                position_ids=self.position_ids,
                seq_lens_kv=self.seq_lens_kv[:, :bsz],
                slot_mapping=self.slot_mapping,
                attention=att,
            )
        if page_table is not None:
            out.attention.page_table = page_table
        return out


def prepare(planner, plan: DraftPlan, P, seq_lens_decoder, accept_num, block_tables) -> tuple[int, Any]:
    """Check the MTP inputs (as compute() checks its own) and write them into ``P`` (a
    MtpParams); returns ``(bsz, page_table views or None)``."""
    dec = check_info("seq_lens_decoder", describe("seq_lens_decoder", seq_lens_decoder), ndim=1, device=planner.device)
    bsz = dec.shape[0]
    acc = check_info("accept_num", describe("accept_num", accept_num), ndim=1, device=planner.device)
    if acc.shape[0] != bsz:
        raise ValueError(f"accept_num must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got {acc.shape}")
    if bsz > planner.max_requests:
        raise ValueError(f"seq_lens_decoder must have at most max_requests = {planner.max_requests} entries, got {bsz}")
    page_table = None
    if planner.num_caches:
        tables = write_tables(
            block_tables,
            planner.num_caches,
            bsz,
            planner.device,
            P.step.block_tables,
            P.step.table_stride,
            P.step.max_blocks,
        )
        if "page_table" in planner.attention:
            import cupy

            page_table = tuple(t[:bsz] if hasattr(t, "__getitem__") else cupy.asarray(t)[:bsz] for t in tables)
    P.step.seq_lens_decoder = dec.ptr  # [bsz], int32
    P.accept_num = acc.ptr  # [bsz], int32
    P.step.bsz = bsz  # int32
    return bsz, page_table


class BoundDraftSteps:
    """The MTP launch bound to persistent inputs (built by
    :meth:`kvaddr.planner.StepPlanner.bind_draft_steps`): :meth:`launch` only launches.

    Holds references to the bound arrays and its own copy of the parameter struct; the
    outputs are the planner's (the same buffers as ``compute_draft_steps``)."""

    def __init__(self, plan: DraftPlan, params, bsz: int, outputs: DraftOutputs, refs: tuple, stream) -> None:
        self.params = params
        self.max_bsz = bsz
        self._refs = refs
        self._outputs = outputs
        self._stream = None if stream is None else stream_handle(stream)
        self._launcher = launcher = kernel_loader.Launcher(plan.launcher.fn, params, by_value=True)
        self._grid = (plan.blocks, plan.threads, plan.k)
        # One driver call per launch (as BoundStep.launch): cuLaunchKernel with the function,
        # grid and kernelParams array fixed here (the driver copies the struct at launch).
        driver = launcher.driver
        self._fast = None if driver is None else driver[0]
        if driver is not None:
            self._fast_args = (driver[1], plan.blocks, plan.k, 1, plan.threads, 1, 1, 0)
            self._params_ptr = driver[2]

    def launch(self, stream: Any = None) -> DraftOutputs:
        """Launch every substep (one kernel launch) on ``stream`` (the bound one, else CuPy's current)."""
        if stream is None:
            handle = self._stream
            if handle is None:
                handle = stream_handle(None)
        elif stream.__class__ is int:
            handle = stream
        else:
            handle = stream_handle(stream)
        if self._fast is not None:
            self._fast(*self._fast_args, handle, self._params_ptr, 0)
            return self._outputs
        blocks, threads, k = self._grid
        self._launcher(blocks, threads, handle, k)
        return self._outputs
