"""The dispatch table: which kernel runs, with which grid, for a planner's configuration and a batch.

Every entry point of the core step (:class:`~kvaddr.planner.StepPlanner`, its bound launch,
the torch ops) and of the vLLM step (:class:`~kvaddr.engines.vllm.VllmStepPlanner`) asks
this module, so the same step runs the same kernel whichever way it is called. The list
of kernels a configuration may run (:func:`step_kernels`, :func:`vllm_kernels`) is what
the loader compiles, and the kernel-choice tests read this table rather than restating it.

The core step has three kernels, each with and without attention-metadata blocks
(kvaddr/kernels/step.cuh):

=====================  =========================  ======================================
batch (bsz requests)   kernel                     grid
=====================  =========================  ======================================
0 .. 256               ``step_small``             ceil(C / T) blocks of T threads,
                       ``step_small_attention``   T = bsz and min(C, 256) rounded up to
                                                  a warp (+ the metadata blocks)
257 .. 4096            ``step_wide``              ceil(C / T) blocks; each thread loads
                       ``step_wide_attention``    R of the bsz lengths (+ metadata blocks)
above 4096             ``step_multiblock``        ceil(C / 256) token blocks, then
                                                  ceil(bsz / 4096) scan tiles (+ metadata)
=====================  =========================  ======================================

With DSA outputs (``StepConfig.dsa``) each kernel is its ``DSA = true`` instantiation (the name
with ``, true`` appended), launched by the planner with a second grid row of as many DSA blocks
(kvaddr/kernels/dsa_step.cuh); the grid above is its first row.

Pure Python over a frozen configuration: no CuPy, no device (the CPU tests run it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvaddr import kernel_loader
from kvaddr.kernel_names import LIBRARY_KERNELS, with_dsa

_C = kernel_loader.constants()
#: Threads per block of ``step_multiblock`` and of the attention variants' blocks at most.
THREADS = _C["KV_THREADS"]
#: Warps (error records) per block of ``step_multiblock``.
WARPS = _C["KV_WARPS"]
#: Requests one scan tile of ``step_multiblock`` covers.
TILE = _C["KV_TILE"]
#: Tokens one token block of ``step_multiblock`` covers.
TOKENS = _C["KV_TOKENS"]
#: The widest block of ``step_small``.
SMALL_MAX_THREADS = _C["KV_SB_THREADS"]
#: The largest batch the across-blocks kernels take (their prefixes fit in shared memory).
WIDE_MAX_REQUESTS = _C["KV_W_MAX"]

#: The largest batch ``step_small`` / ``step_small_attention`` take: above it a block of a
#: thread per request loses to spreading the lengths over threads (step_wide).
SMALL_MAX_REQUESTS = 256
#: The narrowest block of ``step_small`` when the capacity is larger than the batch.
SMALL_MIN_THREADS = 256
#: Requests per thread of ``step_wide``: R, compiled for these values.
WIDE_PER_THREAD = (4, 8, 16)
#: The block ``step_wide`` aims at: R is the smallest of WIDE_PER_THREAD with R x this >= bsz.
WIDE_THREADS = 128
#: Requests per thread of ``step_wide_attention`` (blocks of up to 1024 threads: one request
#: block per 32 requests reads fewer lengths than narrower blocks would).
WIDE_ATTENTION_PER_THREAD = 4
#: ``kv_indices`` entries one metadata block of the small and across-blocks kernels pads at most.
PAD_ENTRIES = 32768
#: The most metadata blocks per cache of ``step_small_attention``.
SMALL_META_MAX_BLOCKS = 32
#: The most pad blocks per cache of ``step_wide_attention``.
WIDE_META_MAX_PAD = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _warp_up(n: int) -> int:
    return (n + 31) & ~31


def attention_meta_geometry(
    attention: Sequence[str], num_caches: int, kv_indices_capacity: int | None, sms: int
) -> tuple[int, int, int]:
    """The metadata blocks of ``step_multiblock``: ``(E, meta_per_cache, num_meta)``.

    E, the ``kv_indices`` entries of one block, is about two blocks per SM over all caches'
    entries, at least 2048, a multiple of 256 (each block also reads every length once);
    "flashinfer" runs ``ceil(N / E)`` blocks per cache, "page_table" alone one per cache,
    "varlen" alone one block, no attention none.

    Parameters
    ----------
    attention : sequence of str
        The normalised attention groups; empty for none.
    num_caches : int
        G, the KV caches (block tables).
    kv_indices_capacity : int or None
        N, the entries of each cache's ``kv_indices`` (None or 0: 1, as without "flashinfer").
    sms : int
        Streaming multiprocessors of the device (132 on an H200).

    Returns
    -------
    tuple of int
        ``(E, meta_per_cache, num_meta)``; ``num_meta`` is 0 without attention.
    """
    groups, G, N = tuple(attention), int(num_caches), int(kv_indices_capacity or 1)
    fi = "flashinfer" in groups
    per = _cdiv(N, max(1, _cdiv(2 * int(sms), max(G, 1))))
    entries = max(2048, _cdiv(per, 256) * 256)
    per_cache = _cdiv(N, entries) if fi else 1
    if not groups:
        num_meta = 0
    elif fi or "page_table" in groups:
        num_meta = G * per_cache
    else:  # varlen alone: one block
        num_meta = 1
    return entries, per_cache, num_meta


@dataclass(frozen=True)
class Launch:
    """One launch: the kernel (its name expression in kvaddr/kernels.cu) and its 1-D grid."""

    kernel: str
    blocks: int
    threads: int


@dataclass(frozen=True)
class StepConfig:
    """What the core step's kernel choice depends on (fixed when a planner is built).

    Parameters
    ----------
    num_caches : int
        G, 0 (positions only) to 4.
    position_int64 : bool
        ``position_ids`` is int64 (else int32).
    capacity : int
        C, the tokens of every per-token output.
    max_requests : int
        The largest bsz.
    attention : tuple of str
        The normalised attention groups (``()``: none).
    kv_indices_capacity : int or None
        N with "flashinfer", else None.
    sms : int
        Streaming multiprocessors of the device (sizes ``step_multiblock``'s metadata blocks).
    dsa : bool
        DSA outputs asked for: every kernel is its ``DSA = true`` instantiation, launched with a
        second grid row of as many DSA blocks (kvaddr/kernels/dsa_step.cuh).
    """

    num_caches: int
    position_int64: bool
    capacity: int
    max_requests: int
    attention: tuple = ()
    kv_indices_capacity: int | None = None
    sms: int = 132
    dsa: bool = False
    #: ``(E, meta_per_cache, num_meta)`` of ``step_multiblock`` (see attention_meta_geometry).
    meta: tuple = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "meta", attention_meta_geometry(self.attention, self.num_caches, self.kv_indices_capacity, self.sms)
        )

    @property
    def has_meta(self) -> bool:
        """Attention outputs asked for: the kernels with metadata blocks run."""
        return bool(self.attention)

    @property
    def meta_rows(self) -> bool:
        """The metadata blocks split requests and table rows per cache ("flashinfer" or "page_table")."""
        return self.num_caches > 0 and ("flashinfer" in self.attention or "page_table" in self.attention)

    @property
    def pos(self) -> str:
        return "long long" if self.position_int64 else "int"

    @property
    def small_max_bsz(self) -> int:
        """The largest bsz ``step_small`` (or ``step_small_attention``) runs."""
        limit = THREADS if self.has_meta else SMALL_MAX_THREADS
        return min(limit, self.max_requests, SMALL_MAX_REQUESTS)

    @property
    def wide_max_bsz(self) -> int:
        """The largest bsz ``step_wide`` (or ``step_wide_attention``) runs (below small_max_bsz: none)."""
        return min(WIDE_MAX_REQUESTS, self.max_requests)


# -- the core step ------------------------------------------------------------------------


def _wide_geometry(cfg: StepConfig, bsz: int) -> tuple[int, int, int]:
    """``(R, blocks, threads)`` of the across-blocks kernels for ``bsz`` requests."""
    if cfg.has_meta:
        r = WIDE_ATTENTION_PER_THREAD
    else:
        r = next((k for k in WIDE_PER_THREAD if k * WIDE_THREADS >= bsz), WIDE_PER_THREAD[-1])
    threads = min(WIDE_MAX_REQUESTS // r, max(32, _warp_up(_cdiv(bsz, r))))
    blocks = _cdiv(cfg.capacity, threads)
    if cfg.has_meta:
        blocks += _wide_meta_blocks(cfg, bsz, threads)
    return r, blocks, threads


def _wide_meta_blocks(cfg: StepConfig, bsz: int, threads: int) -> int:
    """Metadata blocks of ``step_wide_attention``: per cache a request block per ``threads / 32``
    requests and, with "flashinfer", ``ceil(N / PAD_ENTRIES)`` pad blocks (1 to WIDE_META_MAX_PAD);
    "varlen" alone: 1."""
    if not cfg.meta_rows:
        return 1
    k = _cdiv(bsz, threads // 32)
    if cfg.kv_indices_capacity is not None:
        k += min(max(_cdiv(cfg.kv_indices_capacity, PAD_ENTRIES), 1), WIDE_META_MAX_PAD)
    return cfg.num_caches * k


def _small_geometry(cfg: StepConfig, bsz: int) -> tuple[int, int]:
    """``(blocks, threads)`` of the small-batch kernels for ``bsz`` requests."""
    limit = THREADS if cfg.has_meta else SMALL_MAX_THREADS
    threads = min(limit, _warp_up(max(bsz, min(cfg.capacity, SMALL_MIN_THREADS), 32)))
    blocks = _cdiv(cfg.capacity, threads)
    if cfg.has_meta:
        blocks += _small_meta_blocks(cfg, bsz, threads)
    return blocks, threads


def _small_meta_blocks(cfg: StepConfig, bsz: int, threads: int) -> int:
    """Metadata blocks of ``step_small_attention``: per cache enough that every request has a
    warp, and at least ``ceil(N / PAD_ENTRIES)`` for the pad (at most SMALL_META_MAX_BLOCKS);
    "varlen" alone: 1."""
    if not cfg.meta_rows:
        return 1
    k = max(1, _cdiv(bsz, max(1, threads // 32)))
    if cfg.kv_indices_capacity is not None:
        k = max(k, _cdiv(cfg.kv_indices_capacity, PAD_ENTRIES))
    return cfg.num_caches * min(k, SMALL_META_MAX_BLOCKS)


def multiblock_blocks(cfg: StepConfig, bsz: int) -> int:
    """Blocks of ``step_multiblock`` for ``bsz`` requests: token blocks, scan tiles above
    TILE requests, then the metadata blocks."""
    chunks = _cdiv(cfg.capacity, TOKENS)
    tiles = _cdiv(bsz, TILE) if bsz > TILE else 0
    return chunks + tiles + cfg.meta[2]


def step_launch(cfg: StepConfig, bsz: int) -> Launch:
    """The launch of the core step for ``bsz`` requests (``0 <= bsz <= cfg.max_requests``); with
    ``cfg.dsa`` the kernel's DSA instantiation (the grid's second row is the planner's)."""
    launch = _step_launch(cfg, bsz)
    if cfg.dsa:
        return Launch(with_dsa(launch.kernel), launch.blocks, launch.threads)
    return launch


def _step_launch(cfg: StepConfig, bsz: int) -> Launch:
    G, pos = cfg.num_caches, cfg.pos
    if bsz <= cfg.small_max_bsz:
        name = "step_small_attention" if cfg.has_meta else "step_small"
        return Launch(f"{name}<{G}, {pos}>", *_small_geometry(cfg, bsz))
    if bsz <= cfg.wide_max_bsz:
        r, blocks, threads = _wide_geometry(cfg, bsz)
        kernel = f"step_wide_attention<{G}, {pos}>" if cfg.has_meta else f"step_wide<{G}, {pos}, {r}>"
        return Launch(kernel, blocks, threads)
    return Launch(f"step_multiblock<{pos}>", multiblock_blocks(cfg, bsz), THREADS)


def step_kernels(cfg: StepConfig) -> tuple[str, ...]:
    """Every kernel :func:`step_launch` may choose for ``0 <= bsz <= cfg.max_requests``, in
    order of increasing bsz (what a planner compiles when it is built)."""
    out = [step_launch(cfg, 0).kernel]
    if cfg.wide_max_bsz > cfg.small_max_bsz:
        if cfg.has_meta:
            out.append(step_launch(cfg, cfg.small_max_bsz + 1).kernel)
        else:
            lo = cfg.small_max_bsz + 1
            for r in WIDE_PER_THREAD:
                # R serves bsz up to r x WIDE_THREADS (the last R the rest)
                if lo <= cfg.wide_max_bsz:
                    name = f"step_wide<{cfg.num_caches}, {cfg.pos}, {r}>"
                    out.append(with_dsa(name) if cfg.dsa else name)
                    lo = max(lo, r * WIDE_THREADS + 1)
    if cfg.max_requests > cfg.wide_max_bsz:
        out.append(step_launch(cfg, cfg.max_requests).kernel)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class StepRecords:
    """The device state every kernel of a configuration may use, sized once.

    ``tiles`` is ``step_multiblock``'s ``max_tiles``: its scan tiles (``tile_status`` holds
    ``max(tiles, 1)`` words) and the offset of its metadata blocks' records, which follow the
    ``(chunks + tiles) * WARPS`` records of its token blocks and tiles. It is padded so that the
    small and across-blocks kernels' records (one per warp of their grid, from record 0) fit in
    those ``(chunks + tiles) * WARPS`` too. ``records`` is the total, at least
    ``(chunks + tiles + num_meta) * WARPS`` and, with attention outputs, the largest grid of the
    attention kernels.
    """

    chunks: int
    tiles: int
    num_meta: int
    records: int


def step_records(cfg: StepConfig) -> StepRecords:
    """The error records and scan tiles every kernel of ``cfg`` may write (see :class:`StepRecords`)."""
    C, M, G = cfg.capacity, cfg.max_requests, cfg.num_caches
    chunks = _cdiv(C, TOKENS)
    tiles = _cdiv(M, TILE) if M > TILE else 0
    # step_small: ceil(C / T) blocks of T <= SMALL_MAX_THREADS threads, a record per warp;
    # step_wide: blocks of T <= 1024 threads, the same bound.
    small = max(SMALL_MAX_THREADS // 32, _cdiv(C + SMALL_MAX_THREADS, 32))
    tiles = max(tiles, _cdiv(small, WARPS) - chunks)
    records = (chunks + tiles + cfg.meta[2]) * WARPS
    if cfg.has_meta:
        # step_small_attention: blocks of T <= THREADS threads, at most G x SMALL_META_MAX_BLOCKS
        # metadata blocks (1 for varlen alone); step_wide_attention: blocks of T <= 1024 threads,
        # per cache a request block per 32 requests and at most WIDE_META_MAX_PAD pad blocks.
        small_meta = G * SMALL_META_MAX_BLOCKS if cfg.meta_rows else 1
        wide_meta = min(M, WIDE_MAX_REQUESTS) + 32 + WIDE_META_MAX_PAD * 32
        records = max(
            records,
            _cdiv(C + THREADS, 32) + small_meta * WARPS,
            _cdiv(C + 1024, 32) + (G * wide_meta if cfg.meta_rows else 32),
        )
    return StepRecords(chunks, tiles, cfg.meta[2], records)


def launch_records(cfg: StepConfig, launch: Launch, tiles: int) -> int:
    """Error records ``launch`` writes at most (a record per warp from record 0; ``step_multiblock``:
    its token blocks, ``tiles`` scan tiles and metadata blocks)."""
    if launch.kernel.startswith("step_multiblock"):
        return (_cdiv(cfg.capacity, TOKENS) + tiles + cfg.meta[2]) * WARPS
    return launch.blocks * (launch.threads // 32)


# -- the MTP substeps (kvaddr/kernels/mtp.cuh) ----------------------------------------------


def mtp_launch(cfg: StepConfig) -> Launch:
    """The launch of every MTP substep at once: ``mtp_step<pos>`` on a grid of
    ``(blocks, k)`` blocks of ``threads`` (blocks = ceil(C / THREADS); y = the substep),
    whatever the batch (each block owns a range of requests, scans a window of requests holding
    it and sums the lengths outside the window itself)."""
    return Launch(f"mtp_step<{cfg.pos}>", _cdiv(cfg.capacity, THREADS), THREADS)


def mtp_records(cfg: StepConfig, draft_steps: int) -> int:
    """Error records the MTP launch of ``draft_steps`` substeps writes: one per warp of its grid."""
    return int(draft_steps) * _cdiv(cfg.capacity, THREADS) * WARPS


# -- the vLLM step --------------------------------------------------------------------------


def vllm_kernel(attention: bool, dsa: bool = False) -> str:
    """The vLLM step's kernel: ``vllm_step<true>`` writes the attention metadata too; with
    ``dsa`` its DSA instantiation (``vllm_step<..., true>``, launched on two grid rows)."""
    name = "vllm_step<true>" if attention else "vllm_step<false>"
    return with_dsa(name) if dsa else name


def vllm_kernels(attention: bool, dsa: bool = False) -> tuple[str, ...]:
    """The kernels a :class:`~kvaddr.engines.vllm.VllmStepPlanner` launches with ``num_blocks`` in
    device memory."""
    return (vllm_kernel(attention, dsa),)


def vllm_staged_kernels(attention: bool, dsa: bool = False, num_groups: int = 1) -> tuple[str, str]:
    """The two kernels a :class:`~kvaddr.engines.vllm.VllmStepPlanner` of ``num_groups`` KV-cache
    groups launches, in this order, with ``num_blocks`` in pinned host memory:
    ``vllm_stage_num_blocks<num_groups>`` (its device copy) and the step's ``STAGED``
    instantiation, which reads that copy (kvaddr/kernels/vllm.cuh)."""
    a, d = ("true" if attention else "false"), ("true" if dsa else "false")
    return (f"vllm_stage_num_blocks<{num_groups}>", f"vllm_step<{a}, {d}, true>")


def vllm_draft_kernel(attention: bool) -> str:
    """The draft-addressing kernel (:class:`~kvaddr.engines.vllm_draft.VllmDraftPlanner`):
    ``vllm_draft_step<true>`` writes each draft step's attention metadata too."""
    return "vllm_draft_step<true>" if attention else "vllm_draft_step<false>"


@functools.cache
def _known() -> frozenset:
    return frozenset(LIBRARY_KERNELS)


def check_kernels(names: Sequence[str]) -> None:
    """Raise ValueError if a name is not a library kernel of kvaddr/kernel_names.py."""
    unknown = [n for n in names if n not in _known()]
    if unknown:
        raise ValueError(f"not a library kernel: {', '.join(unknown)}")
