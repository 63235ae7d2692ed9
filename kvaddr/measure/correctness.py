"""Element-for-element comparison of a strategy's outputs with the reference.

``kvaddr profile`` runs every strategy on every input set, and replays every
captured graph once, before it times anything; the first difference stops the
run (exit status 1) with the strategy, the output, the index and both values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvaddr.errors import CheckFailed as CheckFailed  # re-exported
from kvaddr.outputs import ATTENTION_FIELDS, OUTPUT_FIELDS

#: Written into a strategy's output buffers before a checked call: an output
#: element the call fails to write then shows up as a difference.
SENTINEL = -7777

#: Attention outputs :func:`poison` fills: the buffers a step writes (``qo_indptr`` and
#: ``seqused_k`` are ``cu_seqlens_q`` / ``seq_lens_kv`` again; ``page_table`` is a view
#: of the inputs and is never written).
POISONED_ATTENTION_FIELDS = (
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "cu_seqlens_k",
    "max_seqlen_q",
    "max_seqlen_k",
)


@dataclass(frozen=True)
class Mismatch:
    """The first difference between a strategy's output and the reference's."""

    strategy: str
    context: str
    output: str
    where: str
    got: object
    expected: object

    def message(self) -> str:
        return (
            f"strategy {self.strategy!r} ({self.context}) differs from the reference in {self.output} "
            f"at {self.where}: got {self.got}, expected {self.expected}"
        )


_INDEX_NAMES = {
    "cu_seqlens_q": "entry",
    "batch_id_per_token": "token",
    "position_ids": "token",
    "seq_lens_kv": "request",
}


def _where(output: str, index: tuple) -> str:
    if output == "slot_mapping":
        return f"token {index[1]} of cache {index[0]} (slot_mapping[{index[0]}, {index[1]}])"
    if output == "num_tokens":
        return "the scalar"
    name = _INDEX_NAMES.get(output, "index")
    return f"{name} {index[0]}"


def to_host(value) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array (CuPy: after the work that wrote it finished)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    get = getattr(value, "get", None)
    if callable(get):
        return np.asarray(get())
    return np.asarray(value)


def compare_outputs(strategy: str, context: str, got, expected) -> Mismatch | None:
    """The first differing element of any output, or None if all are equal.

    Parameters
    ----------
    strategy : str
    context : str
        Where the outputs came from (e.g. ``"eager, batch 64, input set 2"``).
    got, expected : StepOutputs
        ``got`` may hold CuPy arrays; ``expected`` is the reference's.
    """
    for output in OUTPUT_FIELDS:
        g = to_host(getattr(got, output))
        e = np.asarray(getattr(expected, output))
        if g.shape != e.shape:
            return Mismatch(strategy, context, output, "the shape", g.shape, e.shape)
        if g.ndim == 0:
            if g != e:
                return Mismatch(strategy, context, output, _where(output, ()), g.item(), e.item())
            continue
        diff = np.argwhere(g != e)
        if len(diff):
            index = tuple(int(i) for i in diff[0])
            return Mismatch(strategy, context, output, _where(output, index), g[index].item(), e[index].item())
    return _compare_attention(strategy, context, getattr(got, "attention", None), getattr(expected, "attention", None))


def _compare_attention(strategy: str, context: str, got, expected) -> Mismatch | None:
    """The first differing element of the attention outputs (``expected`` the reference's)."""
    if expected is None:
        return None
    if got is None:
        return Mismatch(strategy, context, "attention", "the outputs", None, "AttentionOutputs")
    for name in ATTENTION_FIELDS:
        e_val = getattr(expected, name)
        g_val = getattr(got, name)
        if e_val is None:
            continue
        if g_val is None:
            return Mismatch(strategy, context, f"attention.{name}", "the output", None, "an array")
        pairs = (
            [(f"attention.page_table[{g}]", gv, ev) for g, (gv, ev) in enumerate(zip(g_val, e_val))]
            if name == "page_table"
            else [(f"attention.{name}", g_val, e_val)]
        )
        if name == "page_table" and len(g_val) != len(e_val):
            return Mismatch(strategy, context, "attention.page_table", "the number of caches", len(g_val), len(e_val))
        for label, gv, ev in pairs:
            g, e = to_host(gv), np.asarray(ev)
            if g.shape != e.shape:
                return Mismatch(strategy, context, label, "the shape", g.shape, e.shape)
            diff = np.argwhere(g != e)
            if len(diff):
                index = tuple(int(i) for i in diff[0])
                return Mismatch(strategy, context, label, f"index {index}", g[index].item(), e[index].item())
    return None


def poison(outputs) -> None:
    """Fill every output array with :data:`SENTINEL` (buffers a later call must rewrite).

    Arrays that cannot be written (read-only views) are left alone.
    """
    arrays = [getattr(outputs, output) for output in OUTPUT_FIELDS]
    att = getattr(outputs, "attention", None)
    if att is not None:  # the buffers the step writes (not page_table: views of the inputs)
        arrays += [getattr(att, name) for name in POISONED_ATTENTION_FIELDS]
    for arr in arrays:
        if arr is None:
            continue
        try:
            arr.fill(SENTINEL)
        except (AttributeError, ValueError, TypeError):
            pass
