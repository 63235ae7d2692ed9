"""``kvaddr.planner.attention_meta_geometry``: the attention metadata blocks' geometry, the one
formula StepPlanner and the torch op's packed StepBuffers size the metadata launch with."""

from __future__ import annotations

import pytest

from kvaddr.planner import attention_meta_geometry


@pytest.mark.parametrize(
    ("groups", "G", "N", "sms", "want"),
    [
        # E: about two blocks per SM over all caches, at least 2048, a multiple of 256
        (("flashinfer",), 1, 8, 132, (2048, 1, 1)),
        (("flashinfer", "varlen"), 2, 8 << 20, 132, (63744, 132, 264)),
        (("flashinfer",), 1, 8 << 20, 132, (32000, 263, 263)),  # ceil(N / 264) = 31776 -> 32000
        (("flashinfer",), 4, 1 << 20, 78, (27136, 39, 156)),  # 39 blocks per cache: 26887 -> 27136
        (("flashinfer",), 1, 2049, 132, (2048, 2, 2)),
        # page_table alone: one block per cache; varlen alone: one block; none: none
        (("page_table",), 3, 1, 132, (2048, 1, 3)),
        (("page_table",), 3, None, 132, (2048, 1, 3)),
        (("varlen",), 3, 1, 132, (2048, 1, 1)),
        (("page_table", "varlen"), 2, None, 132, (2048, 1, 2)),
        ((), 3, 1, 132, (2048, 1, 0)),
    ],
)
def test_attention_meta_geometry(groups, G, N, sms, want):
    assert attention_meta_geometry(groups, G, N, sms) == want


def test_every_entry_is_covered_by_the_blocks():
    for G in (1, 2, 4):
        for N in (1, 255, 2048, 2049, 100_000, 8 << 20):
            for sms in (1, 66, 132):
                E, per_cache, num_meta = attention_meta_geometry(("flashinfer",), G, N, sms)
                assert E % 256 == 0 and E >= 2048
                assert (per_cache - 1) * E < N <= per_cache * E and num_meta == G * per_cache
