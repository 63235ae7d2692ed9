"""NumPy reference of FastDeploy MTP draft addressing, in the core step's terms.

The oracle of the draft-addressing kernel's core face (``docs/spec-decode.md``).
Each MTP substep is one core step (:func:`kvaddr.reference.step_addressing`,
``docs/spec.md``), so each substep's outputs are exactly ``compute()``'s
contract for these lengths:

* Substep 0: ``seq_lens_this_time = accept_num`` over ``seq_lens_decoder``, the
  tokens in the cache already rolled back by the rejected drafts.
* Substep j >= 1 (a decode step): every request with ``accept_num[b] > 0`` runs
  one token, ``seq_lens_this_time[b] = 1``, over
  ``seq_lens_decoder[b] + accept_num[b] + (j - 1)``; a request with
  ``accept_num[b] == 0`` runs none and keeps its ``seq_lens_decoder``; a
  negative ``accept_num[b]`` is passed through as ``seq_lens_this_time`` so that
  every substep records error bit 8 (:data:`kvaddr.errors.ERR_NEGATIVE_LENGTH`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from kvaddr.reference import ReferenceResult, as_int32, step_addressing
from kvaddr.validation import check_int


def mtp_substep_lengths(
    seq_lens_decoder: ArrayLike, accept_num: ArrayLike, substep: int
) -> tuple[np.ndarray, np.ndarray]:
    """The core step's lengths of MTP substep ``substep``.

    Parameters
    ----------
    seq_lens_decoder : int32 [bsz]
        Tokens in the cache, rolled back by the rejected drafts.
    accept_num : int32 [bsz]
        Tokens each request accepted (0 for an idle slot).
    substep : int
        j >= 0.

    Returns
    -------
    (int32 [bsz], int32 [bsz])
        ``(seq_lens_decoder_j, seq_lens_this_time_j)``; seq_lens_decoder_j saturates
        at 2**31 - 1.
    """
    dec = as_int32("seq_lens_decoder", seq_lens_decoder).astype(np.int64)
    acc = as_int32("accept_num", accept_num).astype(np.int64)
    if acc.shape != dec.shape:
        raise ValueError(f"accept_num must have shape (bsz,) = {dec.shape} like seq_lens_decoder, got {acc.shape}")
    j = check_int("substep", substep, lo=0)
    if j == 0:
        return dec.astype(np.int32), acc.astype(np.int32)
    run = acc > 0
    dec_j = np.where(run, np.minimum(dec + acc + (j - 1), np.iinfo(np.int32).max), dec)
    q_j = np.where(run, 1, np.minimum(acc, 0))
    return dec_j.astype(np.int32), q_j.astype(np.int32)


def mtp_draft_addressing(
    seq_lens_decoder: ArrayLike,
    accept_num: ArrayLike,
    block_tables: ArrayLike | Sequence[ArrayLike],
    block_sizes: int | Sequence[int],
    capacity: int,
    num_substeps: int,
) -> list[ReferenceResult]:
    """Every MTP substep's addressing, each one core step.

    Parameters
    ----------
    seq_lens_decoder : int32 [bsz]
        Tokens in the cache, already rolled back by the rejected drafts.
    accept_num : int32 [bsz]
        Tokens each request accepted (0 for an idle slot).
    block_tables : int32 [rows >= bsz, max_blocks], or a sequence of them
        As :func:`~kvaddr.reference.step_addressing` takes them.
    block_sizes : int or sequence of int
        Tokens per block, one per cache.
    capacity : int
        C, the most tokens a substep may carry (>= 1).
    num_substeps : int
        Substeps 0 .. num_substeps - 1 (>= 1).

    Returns
    -------
    list of ReferenceResult
        Substep j's :func:`~kvaddr.reference.step_addressing` result, with the
        lengths of :func:`mtp_substep_lengths`.
    """
    steps = check_int("num_substeps", num_substeps, lo=1)
    out = []
    for j in range(steps):
        dec_j, q_j = mtp_substep_lengths(seq_lens_decoder, accept_num, j)
        out.append(step_addressing(dec_j, q_j, block_tables, block_sizes, capacity))
    return out
