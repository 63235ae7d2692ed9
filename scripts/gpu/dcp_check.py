"""Decode context parallelism checked in isolation: one process per GPU, NCCL.

    torchrun --nproc-per-node 2 scripts/gpu/dcp_check.py           # cp_size = 2, cp_rank = rank
    torchrun --nproc-per-node 1 scripts/gpu/dcp_check.py           # one GPU: cp_size 1
    python scripts/gpu/dcp_check.py --single-process --ranks 2,4,8 # one GPU, a loop over the ranks

Every rank builds kvaddr's vLLM step (``VllmStepPlanner``, ``cp_size = N``,
``cp_rank = rank``) for a mixed batch (fresh and chunked prefills, decodes, speculative
tokens, idle and finished requests, a dummy), writes the K/V of the tokens it owns into its
own paged caches through its ``slot_mappings`` over several steps, reads its local KV back
through its gathered block table and ``dcp_local_seq_lens``, computes partial attention
with its log-sum-exp, all-gathers the partials (``torch.distributed.all_gather``) and
merges them. Checked: the merged output equals attention over the contiguous K/V on rank
0 (``scaled_dot_product_attention``, float64); every real token's KV written by exactly
one rank (an unsharded group: by every rank, at one slot); the local lengths add up to
``seq_lens``; every rank's outputs equal the NumPy reference's. Cases: B = 16 and 64,
interleave 1 and B, one group, a sharded plus an unsharded group, two sharded groups
(tests/support/dcp.py holds the simulation and the checks; tests/unit/test_dcp.py runs
them on the CPU in CI).

``--single-process`` plays every rank in one process, one after the other, with no
collective (the gather is a stack). ``--device cpu`` swaps the kernel for the NumPy
reference and runs the attention with PyTorch on the CPU; with ``--backend gloo`` that
runs the collective path without a GPU. ``--fault slot|partial|length`` breaks one thing
on purpose: every case must then FAIL (the check can fail).

NCCL_NVLS_ENABLE is set to 0 unless already set (NVLink multicast
stays off). One PASS/FAIL line per case on rank 0 and a summary; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before torch.distributed initialises NCCL
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout: tests.support

from tests.support.dcp import (
    FAULTS,
    LoopRanks,
    PlannerAddresser,
    ReferenceAddresser,
    Report,
    TorchBackend,
    dcp_cases,
    run_case,
)


class DistRanks:
    """This process is DCP rank ``rank`` of ``world``; the gather is ``torch.distributed.all_gather``."""

    def __init__(self, dist, rank: int, world: int, backend_name: str):
        self.dist, self.cp_size = dist, world
        self.local = [rank]
        self.is_root = rank == 0
        self.name = f"{backend_name}, {world} process{'es' if world > 1 else ''}"

    def gather(self, xs):
        import torch

        (x,) = xs
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.cp_size)]
        self.dist.all_gather(parts, x)
        return torch.stack(parts)


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single-process", action="store_true", help="loop over the ranks in one process (no collective)")
    ap.add_argument("--ranks", default="2", help="cp sizes for --single-process, comma-separated (default 2)")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="torch.distributed backend (torchrun)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the NumPy reference addresses")
    ap.add_argument("--block-sizes", default="16,64", help="B of the first group (default 16,64)")
    ap.add_argument("--requests", type=int, default=16, help="requests per batch (default 16)")
    ap.add_argument("--steps", type=int, default=4, help="steps per case (default 4)")
    ap.add_argument("--max-queries", type=int, default=None, help="queries checked per request and step (all)")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--fault", choices=FAULTS, default=None, help="break one thing: every case must FAIL")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    cases = [
        c for c in dcp_cases(_ints(a.block_sizes), num_reqs=a.requests, steps=a.steps, seed=a.seed) if a.only in c.name
    ]
    dist = None
    if a.single_process:
        rank, world, local_rank = 0, 1, 0
    else:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            print(
                "dcp_check: start it with torchrun (torchrun --nproc-per-node N scripts/gpu/dcp_check.py), "
                "or pass --single-process",
                file=sys.stderr,
            )
            return 2
        import torch.distributed as dist

        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local_rank)
        import cupy

        cupy.cuda.Device(local_rank).use()  # the planner launches on CuPy's view of this device
        device = f"cuda:{local_rank}"
        where = torch.cuda.get_device_name(local_rank)
    else:
        device, where = "cpu", "CPU"
    if dist is not None:
        kw = {"device_id": torch.device(device)} if a.device == "cuda" else {}
        dist.init_process_group(a.backend, **kw)
    backend = TorchBackend(device)
    addresser = PlannerAddresser(backend, local_rank) if a.device == "cuda" else ReferenceAddresser(backend)
    runs = [(cp, LoopRanks(backend, cp)) for cp in _ints(a.ranks)] if a.single_process else []
    if dist is not None:
        runs = [(world, DistRanks(dist, rank, world, a.backend))]
    root = rank == 0
    if root:
        print(
            f"dcp_check: {len(cases)} cases x cp_size {[cp for cp, _ in runs]}, {addresser.name} addressing, "
            f"{device} ({where}), NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}",
            flush=True,
        )
    passed = total = 0
    t0 = time.perf_counter()
    for cp, ranks in runs:
        for case in cases:
            t = time.perf_counter()
            report = run_case(case, cp, backend, addresser, ranks, fault=a.fault, max_queries=a.max_queries)
            report = _combine(dist, report) if dist is not None else report
            total += 1
            passed += report.ok
            if root:
                mode = ranks.name
                head = f"{'PASS' if report.ok else 'FAIL'}  cp_size={cp} {case.name:<12} [{mode}]"
                print(
                    f"{head}  {report.checks} checks, {sum(report.kinds.values())} request-steps, "
                    f"{time.perf_counter() - t:.2f} s",
                    flush=True,
                )
                for f in report.failures[:5]:
                    print(f"      {f}", flush=True)
                if len(report.failures) > 5:
                    print(f"      ... and {len(report.failures) - 5} more", flush=True)
    if root:
        verdict = "OK" if passed == total else "FAILED"
        print(
            f"dcp_check: {passed}/{total} cases passed ({verdict}), {time.perf_counter() - t0:.1f} s"
            + (f", fault {a.fault!r} injected" if a.fault else ""),
            flush=True,
        )
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    return 0 if passed == total else 1


def _combine(dist, report: Report) -> Report:
    """Every rank's report in one: checks added, failures listed with their rank."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (report.checks, report.failures, dict(report.kinds)))
    out = Report()
    for r, (checks, failures, kinds) in enumerate(got):
        out.checks += checks
        out.failures += [f if r == 0 else f"(rank {r}) {f}" for f in failures]
        if r == 0:
            out.kinds.update(kinds)
    return out


if __name__ == "__main__":
    sys.exit(main())
