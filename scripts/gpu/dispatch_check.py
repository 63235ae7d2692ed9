"""Every kernel of the dispatch table, once, against the NumPy reference (a quick acceptance check).

For each batch size at the table's boundaries (0, 1, 256, 257, 1024, 4096, 4097 requests) and
each configuration (one and two caches, int64 and int32 positions, without and with attention
outputs), builds a ``StepPlanner``, runs one random step (decode and mixed prefill) and compares
every output and error record with ``kvaddr.reference.step_addressing``; then the vLLM step with
and without attention. Prints one line per configuration, the kernel it ran and the compile
time of the first planner; exits 1 on any mismatch.

Run on a GPU from the repository root: ``PYTHONPATH=. python scripts/gpu/dispatch_check.py``.
"""

from __future__ import annotations

import sys
import time

import cupy as cp
import numpy as np

from kvaddr import StepPlanner
from kvaddr.reference import step_addressing


def one(rng, bsz: int, G: int, pos, attention, mixed: bool) -> str:
    B, W = 16, 64
    if mixed and bsz:
        q = rng.integers(0, 40, bsz).astype(np.int32)
    else:
        q = np.ones(bsz, dtype=np.int32)
    dec = rng.integers(0, B * W - 41, bsz).astype(np.int32)
    C = max(int(q.sum()) + 7, 1)
    tables = [rng.integers(0, 1 << 20, (bsz, W)).astype(np.int32) for _ in range(G)]
    kw = {}
    if attention:
        kw = dict(attention=attention, kv_indices_capacity=max(bsz * W, 1) if "flashinfer" in attention else None)
    p = StepPlanner(max(bsz, 1), C, [B] * G, position_dtype=pos, **kw)
    out = p.compute(cp.asarray(dec), cp.asarray(q), [cp.asarray(t) for t in tables] if G else None)
    cp.cuda.get_current_stream().synchronize()
    mask, key = p.errors()
    ref = step_addressing(
        dec,
        q,
        tables,
        [B] * G,
        C,
        position_dtype=pos,
        attention=attention,
        **({"kv_indices_capacity": kw.get("kv_indices_capacity")} if attention else {}),
    )
    r = ref.outputs
    bad = []
    for name in ("cu_seqlens_q", "batch_id_per_token", "position_ids", "seq_lens_kv", "slot_mapping"):
        if not np.array_equal(cp.asnumpy(getattr(out, name)), getattr(r, name)):
            bad.append(name)
    if int(out.num_tokens) != int(r.num_tokens):
        bad.append("num_tokens")
    if attention:
        for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_k"):
            got, want = getattr(out.attention, name, None), getattr(r.attention, name, None)
            if want is not None and not np.array_equal(cp.asnumpy(got), want):
                bad.append(name)
    if (mask, key) != (ref.error_mask, ref.error_key):
        bad.append(f"errors {mask:#x}/{key:#x} != {ref.error_mask:#x}/{ref.error_key:#x}")
    kernel = p.kernel_for(bsz)[0]
    return kernel, bad


def main() -> int:
    rng = np.random.default_rng(20261203)
    t0 = time.perf_counter()
    StepPlanner(1, 1, [16])
    print(f"first planner (compiles its kernel): {time.perf_counter() - t0:.2f} s", flush=True)
    failures = 0
    for attention in (None, "flashinfer,varlen"):
        for G in (1, 2):
            for pos in (np.int64, np.int32):
                for bsz in (0, 1, 256, 257, 1024, 4096, 4097):
                    for mixed in (False, True):
                        kernel, bad = one(rng, bsz, G, pos, attention, mixed)
                        status = "ok" if not bad else "MISMATCH " + ", ".join(bad)
                        failures += bool(bad)
                        label = (
                            f"bsz {bsz:5d} G {G} {np.dtype(pos)} {'mixed' if mixed else 'decode'} {attention or '-'}"
                        )
                        print(f"{label:<48} {kernel:<36} {status}", flush=True)
    print(f"dispatch_check: {failures} mismatching configuration(s) ({time.perf_counter() - t0:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
