"""The toy MTP draft loop on the CPU (tests/support/mtp_e2e.py): the NumPy references address the
verify step and every draft substep; K/V written through their slots and read back through their
metadata give the attention of the contiguous K/V, and no draft write leaves its request's
blocks. The GPU twin is tests/gpu/test_mtp_e2e_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvaddr.reference import step_addressing
from kvaddr.spec_reference import mtp_substep_lengths
from tests.support.mtp_e2e import run_mtp_e2e

GROUPS = "flashinfer,varlen,page_table"
N = 4096


def _verify(sizes):
    def verify(dec, q, tables):
        return step_addressing(
            dec, q, tables, sizes, max(int(q.sum()), 1), attention=GROUPS, kv_indices_capacity=N
        ).outputs

    return verify


def _draft(sizes, k, lengths=mtp_substep_lengths):
    def draft(dec, acc, tables):
        C = max(int(acc.sum()), 1)
        out = []
        for j in range(k):
            dj, qj = lengths(dec, acc, j)
            out.append(step_addressing(dj, qj, tables, sizes, C, attention=GROUPS, kv_indices_capacity=N).outputs)
        return out

    return draft


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("sizes", [(4, 3), (16,), (5, 2, 7)])
def test_draft_loop_reads_back_what_it_wrote(k, sizes):
    rep = run_mtp_e2e(_verify(sizes), _draft(sizes, k), k=k, block_sizes=sizes, cycles=5, seed=k)
    assert rep.ok, rep.failures[:5]


def test_the_loop_sees_a_substep_addressed_over_the_wrong_lengths():
    """Substeps j >= 1 addressed as if the rejected drafts were kept (one position too far)."""

    def wrong(dec, acc, j):
        dj, qj = mtp_substep_lengths(dec, acc, j)
        return (dj + (j > 0) * (acc > 0)).astype(np.int32), qj

    rep = run_mtp_e2e(_verify((4, 3)), _draft((4, 3), 3, wrong), k=3, block_sizes=(4, 3), cycles=4)
    assert not rep.ok and rep.failures
