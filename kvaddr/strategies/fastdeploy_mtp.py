"""FastDeploy's MTP draft addressing, re-implemented as a baseline: per substep, single blocks.

Before each of the k draft substeps FastDeploy prepares the substep's lengths with a one-block
kernel, addresses the substep with its one-block step kernel (a thread per request, at most
512 requests in FastDeploy; kvaddr's one-block baseline takes 1024), and synchronises with the
host (it reads the substep's lengths back before the next one). :class:`FastDeployMtp` does
exactly that: per substep ``kvaddr_mtp_substep_lengths`` then ``kvaddr_one_block_i64`` /
``_i32`` (kvaddr/kernels/baselines.cuh), then ``stream.synchronize()``: 2 k launches and k host
synchronisations per verify-plus-drafts cycle, against one launch of
:meth:`kvaddr.planner.StepPlanner.compute_draft_steps`. Outputs go to buffers shaped as the
planner's (``[k, ...]``); error bits 4 and 8 only (those of the one-block baseline).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvaddr import kernel_loader
from kvaddr.device import require_cuda
from kvaddr.errors import StrategyLimitExceeded
from kvaddr.mtp import DraftOutputs
from kvaddr.validation import check_info, check_int, describe, normalize_tables, stream_handle

__all__ = ["MAX_REQUESTS", "FastDeployMtp"]

#: FastDeploy's single-block kernels' limit on requests.
MAX_REQUESTS = 512


class FastDeployMtp:
    """k substeps, each: a one-block length kernel, the one-block step, a host synchronisation.

    Parameters
    ----------
    max_requests : int
        The largest batch (at most :data:`MAX_REQUESTS`).
    capacity : int
        C of every substep.
    block_sizes : int or sequence of int
        B of each cache.
    draft_steps : int
        k, the substeps.
    position_dtype : numpy dtype, default int64
    device : int, optional
    """

    name = "fastdeploy-mtp"

    def __init__(self, max_requests, capacity, block_sizes, draft_steps, *, position_dtype=np.int64, device=None):
        require_cuda(device)
        import cupy

        from kvaddr.planner import StepPlanner

        self.max_requests = check_int("max_requests", max_requests, lo=1, hi=MAX_REQUESTS)
        self.k = check_int("draft_steps", draft_steps, lo=1, hi=1024)
        # The output buffers are a planner's MTP buffers (never launched by this class).
        pl = self._planner = StepPlanner(
            self.max_requests, capacity, block_sizes, position_dtype=position_dtype, device=device, draft_steps=self.k
        )
        self.device, self.capacity, self.num_caches = pl.device, pl.capacity, pl.num_caches
        d = pl._draft
        M, C, G, k = self.max_requests, self.capacity, self.num_caches, self.k
        with cupy.cuda.Device(self.device):
            self._dec = cupy.zeros((k, M), np.int32)  # each substep's seq_lens_decoder
            self._q = cupy.zeros((k, M), np.int32)  # each substep's seq_lens_this_time
            self._record = cupy.asarray(np.array([0, 2**64 - 1] * k, dtype=np.uint64))  # [k, 2], uint64
            cupy.cuda.get_current_stream().synchronize()
        lengths = kernel_loader.get_function("kvaddr_mtp_substep_lengths", self.device)
        step = kernel_loader.get_function(
            "kvaddr_one_block_i64" if pl.position_dtype == np.int64 else "kvaddr_one_block_i32", self.device
        )
        pos_size = np.dtype(pl.position_dtype).itemsize
        self._len_args, self._len_launch, self._step_args, self._step_launch = [], [], [], []
        for j in range(k):
            a = kernel_loader.MtpLengthsArgs()
            a.dec_out = self._dec.data.ptr + 4 * j * M  # [bsz], int32
            a.q_out = self._q.data.ptr + 4 * j * M  # [bsz], int32
            a.substep = j  # int32
            P = kernel_loader.OneBlockParams()
            P.seq_lens_decoder = a.dec_out  # [bsz], int32
            P.seq_lens_this_time = a.q_out  # [bsz], int32
            P.capacity, P.num_caches = C, G  # int32
            for g in range(kernel_loader.MAX_CACHES):
                P.max_blocks[g] = 1
                P.block_size[g] = pl.block_sizes[g] if g < G else 1
            P.cu_seqlens_q = d.cu_seqlens_q.data.ptr + 4 * j * (M + 1)  # [bsz + 1], int32
            P.num_tokens = d.num_tokens.data.ptr + 4 * j  # [], int32
            P.batch_id_per_token = d.batch_id_per_token.data.ptr + 4 * j * C  # [C], int32
            P.position_ids = d.position_ids.data.ptr + pos_size * j * C  # [C]
            P.seq_lens_kv = d.seq_lens_kv.data.ptr + 4 * j * M  # [bsz], int32
            P.slot_mapping = d.slot_mapping.data.ptr + 8 * j * G * C  # [G, C], int64
            P.error_record = self._record.data.ptr + 16 * j  # [2], uint64
            self._len_args.append(a)
            self._step_args.append(P)
            self._len_launch.append(kernel_loader.Launcher(lengths, a))
            self._step_launch.append(kernel_loader.Launcher(step, P, by_value=True))
        self.launches_per_cycle = 2 * k

    def run(self, seq_lens_decoder: Any, accept_num: Any, block_tables: Any, *, stream: Any = None) -> DraftOutputs:
        """Every substep, one after the other (2 k launches, k host synchronisations)."""
        import cupy

        dec = check_info("seq_lens_decoder", describe("seq_lens_decoder", seq_lens_decoder), ndim=1, device=self.device)
        acc = check_info("accept_num", describe("accept_num", accept_num), ndim=1, device=self.device)
        bsz = dec.shape[0]
        if acc.shape[0] != bsz:
            raise ValueError(f"accept_num must have shape (bsz,) = ({bsz},) like seq_lens_decoder, got {acc.shape}")
        if bsz > self.max_requests:
            raise StrategyLimitExceeded(self.name, self.max_requests, bsz, "one block of one thread per request")
        tables = normalize_tables(block_tables, self.num_caches) if self.num_caches else []
        infos = [check_info("block_tables", describe("block_tables", t), ndim=2, min_rows=bsz) for t in tables]
        handle = stream_handle(stream)
        s = cupy.cuda.ExternalStream(handle)
        for j in range(self.k):
            a, P = self._len_args[j], self._step_args[j]
            a.seq_lens_decoder, a.accept_num, a.bsz = dec.ptr, acc.ptr, bsz
            P.bsz = bsz
            for g, info in enumerate(infos):
                P.block_tables[g] = info.ptr
                P.table_stride[g] = info.strides[0]
                P.max_blocks[g] = info.shape[1]
            self._len_launch[j](1, max(bsz, 1), handle)
            self._step_launch[j](1, max(bsz, 1), handle)
            s.synchronize()  # FastDeploy reads the substep's lengths back before the next one
        return self._planner._draft.outputs(bsz, None)
