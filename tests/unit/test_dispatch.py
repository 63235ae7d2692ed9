"""The dispatch table (kvaddr.dispatch): the kernel and grid of every batch, the kernels a
configuration compiles, the error records they write, and the same launch from every entry
point (StepPlanner.compute, a BoundStep, the torch layout). The kernels themselves run in
tests/gpu."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvaddr import dispatch
from kvaddr.kernel_names import LIBRARY_KERNELS
from tests.support.fake_cupy import install_planner_fake

ALL = ("flashinfer", "varlen", "page_table")  # normalised order (outputs.ATTENTION_GROUPS)
BATCHES = (0, 1, 256, 257, 512, 513, 1024, 2048, 4096, 4097)
POS = {True: "long long", False: "int"}


def _config(G, int64, C, M, attention=()):
    if attention and G == 0:
        attention = ("varlen",)  # flashinfer and page_table need a cache
    N = 3 * C + 5 if "flashinfer" in attention else None
    return dispatch.StepConfig(G, int64, C, M, tuple(attention), N)


def _family(kernel: str) -> str:
    return kernel.split("<", 1)[0]


def _per_thread(cfg, launch) -> int:
    """R of an across-blocks launch: the name's last argument (step_wide), or the attention variant's."""
    if _family(launch.kernel) == "step_wide_attention":
        return dispatch.WIDE_ATTENTION_PER_THREAD
    return int(launch.kernel.rstrip(">").rsplit(",", 1)[1])


# -- the kernel by batch size ------------------------------------------------------------------

#: (bsz, kernel without attention, kernel with attention); G and the position type filled in.
EXPECTED = (
    (0, "step_small<{G}, {P}>", "step_small_attention<{G}, {P}>"),
    (1, "step_small<{G}, {P}>", "step_small_attention<{G}, {P}>"),
    (256, "step_small<{G}, {P}>", "step_small_attention<{G}, {P}>"),
    (257, "step_wide<{G}, {P}, 4>", "step_wide_attention<{G}, {P}>"),
    (512, "step_wide<{G}, {P}, 4>", "step_wide_attention<{G}, {P}>"),
    (513, "step_wide<{G}, {P}, 8>", "step_wide_attention<{G}, {P}>"),
    (1024, "step_wide<{G}, {P}, 8>", "step_wide_attention<{G}, {P}>"),
    (2048, "step_wide<{G}, {P}, 16>", "step_wide_attention<{G}, {P}>"),
    (4096, "step_wide<{G}, {P}, 16>", "step_wide_attention<{G}, {P}>"),
    (4097, "step_multiblock<{P}>", "step_multiblock<{P}>"),
)


@pytest.mark.parametrize("G", range(5))
@pytest.mark.parametrize("int64", [True, False])
@pytest.mark.parametrize("attention", [(), ALL])
@pytest.mark.parametrize("capacity", [1, 4096, 20000])
def test_the_kernel_by_batch_size(G, int64, attention, capacity):
    cfg = _config(G, int64, capacity, 5000, attention)
    assert [b for b, *_ in EXPECTED] == list(BATCHES)
    for bsz, plain, with_attention in EXPECTED:
        want = (with_attention if attention else plain).format(G=G, P=POS[int64])
        assert dispatch.step_launch(cfg, bsz).kernel == want, bsz


def test_a_small_max_requests_never_reaches_the_larger_kernels():
    for M, last in ((256, "step_small"), (4096, "step_wide")):
        cfg = _config(1, True, 64, M)
        assert [_family(k) for k in dispatch.step_kernels(cfg)][-1] == last
        assert _family(dispatch.step_launch(cfg, M).kernel) == last


# -- the kernels a configuration compiles -------------------------------------------------------

CONFIGS = [
    (G, int64, C, M, attention)
    for G, int64, (C, M), attention in itertools.product(
        range(5),
        (True, False),
        ((1, 1), (300, 256), (4096, 600), (1, 1100), (20000, 4096), (5000, 4097), (9000, 8200)),
        ((), ALL, ("varlen",), ("page_table",)),
    )
]


@pytest.mark.parametrize("G,int64,C,M,attention", CONFIGS)
def test_every_batch_of_a_configuration(G, int64, C, M, attention):
    """Brute force over bsz in [0, max_requests]:

    * step_kernels lists each kernel step_launch chooses, once, in the order of the batches that
      first choose it, and nothing else; every name is a library kernel (what the loader compiles);
    * every grid covers the batch and the capacity: the token blocks x threads >= C (the
      multi-block kernel: its token blocks x KV_TOKENS, its scan tiles x KV_TILE >= bsz), a thread
      per request in the small kernels, R x threads >= bsz across blocks (and R x threads within
      the kernel's shared prefixes), metadata blocks after the token blocks with attention only;
    * the records the planner allocates (step_records) cover every launch's; the small and
      across-blocks kernels without attention write within the token blocks' and scan tiles'.
    """
    cfg = _config(G, int64, C, M, attention)
    rec = dispatch.step_records(cfg)
    assert rec.chunks == -(-C // dispatch.TOKENS) and rec.num_meta == cfg.meta[2]
    assert rec.tiles * dispatch.TILE >= (M if M > dispatch.TILE else 0)
    assert rec.records >= (rec.chunks + rec.tiles + rec.num_meta) * dispatch.WARPS
    seen = {}
    for bsz in range(M + 1):
        launch = dispatch.step_launch(cfg, bsz)
        seen.setdefault(launch.kernel, bsz)
        _check_grid(cfg, bsz, launch)
        n = dispatch.launch_records(cfg, launch, rec.tiles)
        assert n <= rec.records, (bsz, launch)
        if not attention and not launch.kernel.startswith("step_multiblock"):
            assert n <= (rec.chunks + rec.tiles) * dispatch.WARPS, (bsz, launch)
    assert list(dispatch.step_kernels(cfg)) == list(seen)
    assert set(seen) <= set(LIBRARY_KERNELS)
    dispatch.check_kernels(list(seen))


def _check_grid(cfg, bsz, launch):
    family, T, blocks, C = _family(launch.kernel), launch.threads, launch.blocks, cfg.capacity
    assert T % 32 == 0 and 32 <= T <= 1024, (bsz, launch)
    if family == "step_multiblock":
        tiles = -(-bsz // dispatch.TILE) if bsz > dispatch.TILE else 0
        assert T == dispatch.THREADS, (bsz, launch)
        assert (blocks - tiles - cfg.meta[2]) * dispatch.TOKENS >= C, (bsz, launch)
        return
    token_blocks = -(-C // T)
    assert blocks * T >= C and blocks >= token_blocks, (bsz, launch)
    # the attention kernels run metadata blocks after the token blocks, the others none
    assert (blocks > token_blocks) if cfg.has_meta else (blocks == token_blocks), (bsz, launch)
    if family.startswith("step_small"):
        assert bsz <= T <= (dispatch.THREADS if cfg.has_meta else dispatch.SMALL_MAX_THREADS), (bsz, launch)
    else:
        r = _per_thread(cfg, launch)
        assert r in dispatch.WIDE_PER_THREAD and bsz <= r * T <= dispatch.WIDE_MAX_REQUESTS, (bsz, launch)


def test_the_vllm_kernels_are_library_kernels():
    assert dispatch.vllm_kernels(False) == (dispatch.vllm_kernel(False),) == ("vllm_step<false>",)
    assert dispatch.vllm_kernels(True) == (dispatch.vllm_kernel(True),) == ("vllm_step<true>",)
    dispatch.check_kernels(dispatch.vllm_kernels(False) + dispatch.vllm_kernels(True))
    with pytest.raises(ValueError, match="not a library kernel: step_small<5, int>"):
        dispatch.check_kernels(["step_small<5, int>"])


# -- every entry point launches the table's choice ----------------------------------------------


def _inputs(fake, bsz, G):
    dec = fake.array(np.zeros(bsz, np.int32))
    q = fake.array(np.ones(bsz, np.int32))
    tables = [fake.array(np.zeros((max(bsz, 1), 4), np.int32)) for _ in range(G)]
    return dec, q, tables if G else None


@pytest.mark.parametrize(
    "G,int64,C,M,attention",
    [
        (1, True, 2048, 5000, ()),
        (0, False, 100, 4097, ()),
        (2, True, 4096, 4500, ALL),
        (3, False, 64, 300, ("varlen",)),
    ],
)
def test_the_planner_and_its_binding_launch_the_tables_choice(monkeypatch, G, int64, C, M, attention):
    fake = install_planner_fake(monkeypatch)
    from kvaddr.planner import StepPlanner

    kw = dict(attention=attention, kv_indices_capacity=3 * C + 5) if attention else {}
    p = StepPlanner(M, C, [16] * G, position_dtype=np.int64 if int64 else np.int32, **kw)
    cfg = p.config
    assert cfg == _config(G, int64, C, M, attention)
    assert set(p._functions) == set(dispatch.step_kernels(cfg))  # compiled at construction, nothing else
    rec = dispatch.step_records(cfg)
    assert (p._num_chunks, p._max_tiles, p._num_meta) == (rec.chunks, rec.tiles, rec.num_meta)
    assert p._records.size == 2 * rec.records
    dec, q, tables = _inputs(fake, M, G)
    bound = p.bind(dec, q, tables, stream=3)
    for bsz in (*(b for b in BATCHES if b <= M), M):
        launch = dispatch.step_launch(cfg, bsz)
        assert p.kernel_for(bsz) == (launch.kernel, launch.blocks, launch.threads)
        assert p.grid(bsz) == bound.grid(bsz) == launch.blocks
        p.compute(*_inputs(fake, bsz, G))
        bound.launch(bsz)
        for got in fake.launches[-2:]:
            assert (fake.kernel(got["fptr"]), got["grid"], got["block"]) == (
                launch.kernel,
                launch.blocks,
                launch.threads,
            ), bsz
            assert got["params"].bsz == bsz


@pytest.mark.parametrize("attention", [(), ALL])
def test_the_torch_layout_chooses_the_planners_launch(monkeypatch, attention):
    pytest.importorskip("torch")
    install_planner_fake(monkeypatch)
    from kvaddr.planner import StepPlanner
    from kvaddr.torch.ops import _Layout

    C, M, N = 4096, 5000, 9000
    kw = dict(attention=attention, kv_indices_capacity=N) if attention else {}
    p = StepPlanner(M, C, [16, 32], **kw)
    lay = _Layout(C, M, (16, 32), True, attention, N if attention else None, p.config.sms)
    assert lay.config == p.config and lay.tiles == p._max_tiles
    for bsz in (*(b for b in BATCHES if b <= M), M):
        launch = dispatch.step_launch(lay.config, bsz)
        assert p.kernel_for(bsz) == (launch.kernel, launch.blocks, launch.threads)
