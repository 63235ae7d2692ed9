"""Model presets and the decode batches ``kvaddr profile`` replays.

A batch is what one step of a serving engine hands to step addressing: per
request the tokens already in the KV cache (``seq_lens_decoder``), the tokens it
runs this step (``seq_lens_this_time``), its prefill tokens
(``seq_lens_encoder``) and its block-table row. Batches are drawn from a seeded
:class:`numpy.random.Generator`, so a seed names a batch exactly.

How a batch is drawn (see :func:`make_batch`):

* Decode requests run ``1 + spec_tokens`` tokens (one plus the speculative /
  MTP draft tokens). Their context (``seq_lens_decoder``) is drawn
  log-uniformly from ``[lo, hi]`` (default 1024 to 32768 tokens): most requests
  of a chat or agent workload are short, a few are long.
* ``prefill = (N, LEN)`` makes N of the batch's requests chunked-prefill
  requests of LEN tokens (``seq_lens_encoder = seq_lens_this_time = LEN``);
  about half of them are a continuation chunk (``seq_lens_decoder`` a nonzero
  multiple of LEN), the others a first chunk (``seq_lens_decoder = 0``). They
  sit at random positions in the batch.
* Block ids come from a shuffled pool about 25 % larger than the batch needs,
  so a request's blocks are scattered like those of a long-running server, not
  0, 1, 2, ... Entries past a request's allocated blocks are -1.
* The table width (``max_blocks``) is the same for every batch of a shape: the
  longest sequence the shape allows, in blocks.
* The capacity C is the batch's token count, the same for every batch of a
  shape.

Caches with the same block size share one block table (DeepSeek-V3.2's MLA and
indexer caches do); caches with different block sizes get a table each, drawn
from their own pools.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: Default range of context lengths (tokens already in the KV cache).
DEFAULT_CONTEXT = (1024, 32768)
#: Block-pool slack: the pool holds this many times the blocks a batch needs.
POOL_SLACK = 1.25


@dataclass(frozen=True)
class ModelPreset:
    """The shape of a model's KV addressing.

    Attributes
    ----------
    name : str
        What ``--model`` calls it.
    num_layers : int
        Transformer layers that each address every cache once per step.
    num_caches : int
        Paged caches per layer.
    block_size : int
        Tokens per block (the same for every cache of the preset).
    cache_names : tuple of str
        What each cache holds, for reports.
    source : str
        Where the numbers come from.
    """

    name: str
    num_layers: int
    num_caches: int
    block_size: int
    cache_names: tuple
    source: str


PRESETS = {
    "deepseek-v3.2": ModelPreset(
        name="deepseek-v3.2",
        num_layers=61,
        num_caches=2,
        block_size=64,
        cache_names=("MLA latent cache (fp8_ds_mla, 656 B/token)", "DSA indexer key cache (132 B/token)"),
        source="DeepSeek-V3.2: 61 transformer layers (the MTP layer not counted), two caches per layer "
        "sharing one block table with B = 64 (docs/spec.md)",
    ),
    # GLM-5 (glm_moe_dsa) runs the same DSA attention layers as DeepSeek-V3.2: an MLA
    # latent cache and an indexer key cache per layer, one shared block table, B = 64.
    # The layer count is an ASSUMPTION: 78 is GLM-5's num_hidden_layers as other code
    # bases quote it (they put the MTP layer at index 78); it was not checked against
    # zai-org's released config.json. Override it with --layers if yours differs.
    "glm-5": ModelPreset(
        name="glm-5",
        num_layers=78,
        num_caches=2,
        block_size=64,
        cache_names=("MLA latent cache", "DSA indexer key cache"),
        source="GLM-5 (glm_moe_dsa): DeepSeek-V3.2's DSA layer structure; 78 layers is an assumption "
        "(num_hidden_layers as quoted by third-party code, not checked against the released config)",
    ),
}
DEFAULT_MODEL = "deepseek-v3.2"


@dataclass(frozen=True)
class Workload:
    """Everything that shapes the batches of one profile run (all batch sizes).

    Attributes
    ----------
    model : str
        Preset name.
    num_layers, num_caches : int
        L and G.
    block_sizes : tuple of int
        B of each cache (length G).
    context : tuple of int
        ``(lo, hi)`` range of decode requests' ``seq_lens_decoder``, drawn
        log-uniformly (lo == hi: every request has that context).
    spec_tokens : int
        Speculative (MTP) tokens per decode request: each runs 1 + spec_tokens.
    prefill : tuple of int or None
        ``(N, LEN)``: N chunked-prefill requests of LEN tokens per batch.
    seed : int
        Root seed; input set ``i`` of batch size ``b`` uses
        ``SeedSequence([seed, b, i])``.
    input_sets : int
        Distinct batches per batch size, rotated while timing.
    """

    model: str
    num_layers: int
    num_caches: int
    block_sizes: tuple
    context: tuple = DEFAULT_CONTEXT
    spec_tokens: int = 0
    prefill: tuple | None = None
    seed: int = 0
    input_sets: int = 4

    @property
    def shared_table(self) -> bool:
        """True when every cache has the same B, so one table serves them all."""
        return len(set(self.block_sizes)) == 1

    @property
    def decode_tokens(self) -> int:
        """Tokens one decode request runs per step."""
        return 1 + self.spec_tokens

    def num_prefill(self, batch: int) -> int:
        return 0 if self.prefill is None else min(self.prefill[0], batch)

    def capacity(self, batch: int) -> int:
        """C: the token count of every batch of this size."""
        n_pre = self.num_prefill(batch)
        return (batch - n_pre) * self.decode_tokens + (n_pre * self.prefill[1] if n_pre else 0)

    def longest_sequence(self) -> int:
        """The most tokens (context plus this step's) any request of the workload reaches."""
        longest = self.context[1] + self.decode_tokens
        if self.prefill is not None and self.prefill[0] > 0:
            longest = max(longest, _prefill_span(self.context[1], self.prefill[1]))
        return longest

    def max_blocks(self, block_size: int) -> int:
        """Block-table width for caches of this block size."""
        return max(1, -(-self.longest_sequence() // block_size))

    def describe(self) -> dict:
        """A JSON-ready summary (the ``workload`` object of the JSON report)."""
        preset = PRESETS.get(self.model)
        return {
            "model": self.model,
            "model_source": preset.source if preset else None,
            "num_layers": self.num_layers,
            "num_caches": self.num_caches,
            "block_sizes": list(self.block_sizes),
            "shared_table": self.shared_table,
            "context": {
                "lo": self.context[0],
                "hi": self.context[1],
                "distribution": "constant" if self.context[0] == self.context[1] else "log-uniform",
            },
            "spec_tokens": self.spec_tokens,
            "prefill": None if self.prefill is None else {"requests": self.prefill[0], "tokens": self.prefill[1]},
            "seed": self.seed,
            "input_sets": self.input_sets,
            "block_pool_slack": POOL_SLACK,
        }


@dataclass
class Batch:
    """One step's inputs as int32 NumPy arrays (the spec's input table).

    Attributes
    ----------
    seq_lens_decoder, seq_lens_this_time, seq_lens_encoder : int32 [bsz]
    block_tables : list of int32 [bsz, max_blocks]
        One table per cache; caches with the same block size hold the same
        array object (a shared table).
    block_sizes : tuple of int
    capacity : int
        C, the batch's token count.
    seed : list of int
        The entropy of the batch's SeedSequence.
    """

    seq_lens_decoder: np.ndarray
    seq_lens_this_time: np.ndarray
    seq_lens_encoder: np.ndarray
    block_tables: list
    block_sizes: tuple
    capacity: int
    seed: list = field(default_factory=list)

    @property
    def bsz(self) -> int:
        return int(self.seq_lens_decoder.shape[0])

    @property
    def tables_arg(self):
        """``block_tables`` as the library takes it: one array when shared, else a list."""
        tables = self.block_tables
        if all(t is tables[0] for t in tables):
            return tables[0]
        return list(tables)

    def distinct_tables(self) -> list:
        """Each table once, in cache order."""
        seen, out = set(), []
        for t in self.block_tables:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def stats(self) -> dict:
        """A JSON-ready summary of the batch."""
        dec = self.seq_lens_decoder.astype(np.int64)
        q = self.seq_lens_this_time.astype(np.int64)
        enc = self.seq_lens_encoder.astype(np.int64)
        decode = enc == 0
        return {
            "seed": list(self.seed),
            "tokens": int(q.sum()),
            "decode_requests": int(decode.sum()),
            "prefill_requests": int((~decode).sum()),
            "prefill_continuations": int(((~decode) & (dec > 0)).sum()),
            "context_min": int(dec[decode].min()) if decode.any() else None,
            "context_median": float(np.median(dec[decode])) if decode.any() else None,
            "context_max": int(dec[decode].max()) if decode.any() else None,
            "blocks_allocated": [int((t >= 0).sum()) for t in self.distinct_tables()],
            "max_blocks": [int(t.shape[1]) for t in self.distinct_tables()],
        }


def _prefill_span(context_hi: int, chunk: int) -> int:
    """The longest ``seq_lens_decoder + LEN`` of a prefill chunk."""
    return max(context_hi, 2 * chunk)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int, n: int) -> np.ndarray:
    """n integers in [lo, hi], log-uniform in (value + 1)."""
    if lo == hi:
        return np.full(n, lo, dtype=np.int64)
    u = rng.uniform(math.log(lo + 1), math.log(hi + 2), size=n)
    return np.clip(np.floor(np.exp(u)).astype(np.int64) - 1, lo, hi)


def _block_table(rng: np.random.Generator, seq_ends: np.ndarray, block_size: int, max_blocks: int) -> np.ndarray:
    """Rows of block ids from a shuffled pool; -1 past each request's last block."""
    need = -(-seq_ends // block_size)
    total = int(need.sum())
    pool = rng.permutation(math.ceil(total * POOL_SLACK) + 16)[:total]
    table = np.full((seq_ends.shape[0], max_blocks), -1, dtype=np.int32)
    start = 0
    for b, n in enumerate(need.tolist()):
        table[b, :n] = pool[start : start + n]
        start += n
    return table


def make_batch(workload: Workload, batch: int, index: int) -> Batch:
    """Input set ``index`` of batch size ``batch``.

    Parameters
    ----------
    workload : Workload
    batch : int
        Requests in the step (bsz), prefill requests included.
    index : int
        Which input set (0 .. input_sets - 1); each has its own seed.

    Returns
    -------
    Batch
    """
    seed = [int(workload.seed), int(batch), int(index)]
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    lo, hi = workload.context
    dec = _log_uniform(rng, lo, hi, batch)
    q = np.full(batch, workload.decode_tokens, dtype=np.int64)
    enc = np.zeros(batch, dtype=np.int64)
    n_pre = workload.num_prefill(batch)
    if n_pre:
        chunk = workload.prefill[1]
        slots = np.sort(rng.choice(batch, size=n_pre, replace=False))
        most_chunks = max(1, _prefill_span(hi, chunk) // chunk - 1)
        for j, b in enumerate(slots.tolist()):
            q[b] = enc[b] = chunk
            # Alternate first chunks and continuation chunks, shifted by the input set,
            # so a single prefill request is a continuation in every other input set.
            dec[b] = 0 if (j + index) % 2 == 0 else chunk * int(rng.integers(1, most_chunks + 1))
    ends = dec + q
    tables_by_size = {
        B: _block_table(rng, ends, B, workload.max_blocks(B)) for B in dict.fromkeys(workload.block_sizes)
    }
    return Batch(
        seq_lens_decoder=dec.astype(np.int32),
        seq_lens_this_time=q.astype(np.int32),
        seq_lens_encoder=enc.astype(np.int32),
        block_tables=[tables_by_size[B] for B in workload.block_sizes],
        block_sizes=tuple(workload.block_sizes),
        capacity=workload.capacity(batch),
        seed=seed,
    )


def make_input_sets(workload: Workload, batch: int) -> list:
    """The ``workload.input_sets`` batches of one size, rotated while timing."""
    return [make_batch(workload, batch, i) for i in range(workload.input_sets)]
