"""A seeded serving simulator that writes kvaddr traces (``kvaddr trace generate``).

It models what shapes a decode batch over a serving run, step by step, after
vLLM V1's scheduler:

* **Arrivals**: each step, a Poisson number of new requests (mean
  ``arrival_rate``) join the waiting queue (at most ``max_waiting``; the
  rest are rejected). Each draws a prompt and an output length from a named
  :class:`Distribution`.
* **Scheduling** under a token budget (``max_batched_tokens``): running
  requests first, in admission order (a decode request runs ``1 + k``
  tokens, ``k`` speculative tokens; a request still in prefill runs its next
  chunk, as much as the budget leaves), then waiting requests are admitted
  while fewer than ``max_running`` run and budget is left (chunked prefill).
* **Speculative decoding**: each of the ``k`` draft tokens is accepted with
  probability ``acceptance``, in order, until the first rejection; a step
  then adds ``1 + accepted`` tokens to the sequence.
* **Paged KV cache**: one :class:`BlockAllocator` per distinct block size,
  with ``kv_tokens // B`` blocks and a FIFO free list (blocks freed by a
  finished request go to the back and are reused later), so block tables
  fragment as on a long-running server. When a running request needs a
  block and none is free, the newest running request is preempted: its
  blocks are freed and it goes back to the front of the queue, to be
  recomputed (vLLM's recompute preemption). A request that could never fit
  the pool is rejected on arrival.

One step of the trace is one engine step that runs at least one token; idle
steps (nothing to run) are not written. Every random draw comes from one
``numpy.random.Generator`` seeded with ``seed``: the same settings and seed
give the same trace, byte for byte.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import numpy as np

from kvaddr.errors import AllocatorError

#: Longest prompt or output a distribution may produce.
MAX_LENGTH = 1 << 24
#: Consecutive idle steps after which the simulation gives up (no work arrives).
MAX_IDLE_STEPS = 1_000_000


# ----------------------------------------------------------------------------- length distributions


@dataclass(frozen=True)
class Distribution:
    """A named distribution of token counts (integers >= 1).

    ``fixed:N``; ``uniform:LO:HI`` and ``loguniform:LO:HI`` (inclusive);
    ``lognormal:MEDIAN:SIGMA[:MAX]`` (``exp`` of a normal with mean
    ``ln MEDIAN`` and standard deviation SIGMA, rounded, clipped to
    ``[1, MAX]``). A bare ``N`` means ``fixed:N``.
    """

    kind: str
    params: tuple

    KINDS: ClassVar[dict] = {
        "fixed": "fixed:N",
        "uniform": "uniform:LO:HI",
        "loguniform": "loguniform:LO:HI",
        "lognormal": "lognormal:MEDIAN:SIGMA[:MAX]",
    }

    @classmethod
    def parse(cls, text: str) -> Distribution:
        """Parse a spec; raise ValueError with what is wrong."""
        text = str(text).strip()
        parts = [p.strip() for p in text.split(":")]
        kind = parts[0].lower()
        if kind.isdigit() and len(parts) == 1:
            kind, parts = "fixed", ["fixed", parts[0]]
        forms = "; ".join(cls.KINDS.values())
        if kind not in cls.KINDS:
            raise ValueError(f"unknown distribution {parts[0]!r} (one of: {forms})")
        args = parts[1:]

        def integer(s, what):
            try:
                v = int(s)
            except ValueError:
                raise ValueError(f"{what} must be an integer, got {s!r} in {text!r}") from None
            if not 1 <= v <= MAX_LENGTH:
                raise ValueError(f"{what} must be in [1, {MAX_LENGTH}], got {v} in {text!r}")
            return v

        if kind == "fixed":
            if len(args) != 1:
                raise ValueError(f"expected {cls.KINDS[kind]}, got {text!r}")
            return cls(kind, (integer(args[0], "N"),))
        if kind in ("uniform", "loguniform"):
            if len(args) != 2:
                raise ValueError(f"expected {cls.KINDS[kind]}, got {text!r}")
            lo, hi = integer(args[0], "LO"), integer(args[1], "HI")
            if lo > hi:
                raise ValueError(f"LO must be <= HI, got {lo}:{hi} in {text!r}")
            return cls(kind, (lo, hi))
        if len(args) not in (2, 3):
            raise ValueError(f"expected {cls.KINDS[kind]}, got {text!r}")
        median = integer(args[0], "MEDIAN")
        try:
            sigma = float(args[1])
        except ValueError:
            raise ValueError(f"SIGMA must be a number, got {args[1]!r} in {text!r}") from None
        if not (math.isfinite(sigma) and 0 <= sigma <= 10):
            raise ValueError(f"SIGMA must be in [0, 10], got {args[1]} in {text!r}")
        top = integer(args[2], "MAX") if len(args) == 3 else MAX_LENGTH
        return cls(kind, (median, sigma, top))

    def sample(self, rng: np.random.Generator) -> int:
        """One draw."""
        k, p = self.kind, self.params
        if k == "fixed":
            return p[0]
        if k == "uniform":
            return int(rng.integers(p[0], p[1] + 1))
        if k == "loguniform":
            v = int(math.exp(rng.uniform(math.log(p[0]), math.log(p[1] + 1))))
            return min(max(v, p[0]), p[1])
        v = round(p[0] * math.exp(p[1] * rng.standard_normal()))
        return min(max(v, 1), p[2])

    @property
    def upper(self) -> int:
        """The largest value it can produce."""
        return {"fixed": self.params[0], "uniform": self.params[-1], "loguniform": self.params[-1]}.get(
            self.kind, self.params[-1]
        )

    def __str__(self) -> str:
        if self.kind == "lognormal":
            median, sigma, top = self.params
            return f"lognormal:{median}:{sigma:g}" + (f":{top}" if top != MAX_LENGTH else "")
        return ":".join([self.kind] + [str(v) for v in self.params])


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class GeneratorConfig:
    """Everything that shapes a generated trace (``kvaddr trace generate``'s options).

    Attributes
    ----------
    steps : int
        Steps to write (engine steps that run at least one token).
    warmup_steps : int
        Steps simulated, and not written, before the first written one (so
        the trace starts on a busy, fragmented server).
    arrival_rate : float
        Mean new requests per engine step (Poisson).
    prompt_len, output_len : Distribution
    max_running : int
        Most requests running at once (vLLM's max_num_seqs).
    max_batched_tokens : int
        Token budget of one step (vLLM's max_num_batched_tokens).
    spec_tokens : int
        Speculative (draft) tokens per decode request and step.
    acceptance : float
        Probability that each draft token is accepted (until the first rejection).
    block_sizes : tuple of int
        B of each cache; caches with the same B share one block table.
    kv_tokens : int
        KV-cache capacity in tokens, per block table: ``kv_tokens // B`` blocks.
    max_waiting : int
        Longest waiting queue; further arrivals are rejected.
    seed : int
    model : str or None
        The preset the trace is for (written in the header).
    """

    steps: int = 1000
    warmup_steps: int = 0
    arrival_rate: float = 0.5
    prompt_len: Distribution = field(default_factory=lambda: Distribution.parse("lognormal:1024:1.0:32768"))
    output_len: Distribution = field(default_factory=lambda: Distribution.parse("lognormal:256:0.8:4096"))
    max_running: int = 256
    max_batched_tokens: int = 8192
    spec_tokens: int = 0
    acceptance: float = 0.8
    block_sizes: tuple = (64, 64)
    kv_tokens: int = 1 << 19
    max_waiting: int = 1024
    seed: int = 0
    model: str | None = None

    def __post_init__(self):
        if self.max_batched_tokens < 1 + self.spec_tokens:
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must fit one decode request's "
                f"1 + spec_tokens = {1 + self.spec_tokens} tokens"
            )
        if not self.block_sizes or any(b < 1 for b in self.block_sizes):
            raise ValueError(f"block_sizes must be one or more integers >= 1, got {self.block_sizes}")
        if any(self.kv_tokens // b < 1 for b in self.block_sizes):
            raise ValueError(f"kv_tokens ({self.kv_tokens}) must hold at least one block of every size")

    @property
    def distinct_sizes(self) -> tuple:
        return tuple(dict.fromkeys(self.block_sizes))

    def num_blocks(self, block_size: int) -> int:
        return self.kv_tokens // block_size

    def describe(self) -> dict:
        """A JSON-ready record (the trace header's ``generator``)."""
        d = asdict(self)
        d["prompt_len"], d["output_len"] = str(self.prompt_len), str(self.output_len)
        d["block_sizes"] = list(self.block_sizes)
        d["num_blocks"] = [self.num_blocks(b) for b in self.distinct_sizes]
        d.pop("model")
        return d


# ----------------------------------------------------------------------------- the block allocator


class BlockAllocator:
    """A pool of block ids ``0 .. num_blocks - 1`` with a FIFO free list.

    Allocation takes blocks from the front of the free list, freeing appends
    them to the back (vLLM's free block queue order), so a freed block is
    reused once the blocks freed before it are. Starting from 0, 1, 2, ...,
    the free list's order, and with it the block tables, fragment as
    requests of different lengths come and go.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._free = deque(range(self.num_blocks))
        self._is_free = bytearray(b"\x01") * self.num_blocks
        self._used = bytearray(self.num_blocks)
        self.allocations = 0
        self.reuses = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:
        return bool(self._is_free[block])

    def free_ids(self) -> list:
        """The free list, front first."""
        return list(self._free)

    def allocate(self, n: int) -> list | None:
        """``n`` blocks from the front of the free list, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pop = self._free.popleft
        out = [pop() for _ in range(n)]
        is_free, used = self._is_free, self._used
        for b in out:
            is_free[b] = 0
            if used[b]:
                self.reuses += 1
            used[b] = 1
        self.allocations += n
        return out

    def free(self, blocks) -> None:
        """Return blocks to the back of the free list, in the order given."""
        is_free = self._is_free
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise AllocatorError(f"block {b} is not in the pool of {self.num_blocks}")
            if is_free[b]:
                raise AllocatorError(f"block {b} freed twice")
            is_free[b] = 1
            self._free.append(b)


# ----------------------------------------------------------------------------- the simulator


class Request:
    """One request's state in the simulator."""

    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "generated",
        "output_len",
        "preemptions",
        "prompt_len",
        "rid",
        "target",
    )

    def __init__(self, rid: int, arrival: int, prompt_len: int, output_len: int, num_pools: int):
        self.rid, self.arrival = rid, arrival
        self.prompt_len, self.output_len = prompt_len, output_len
        self.generated = 0  # output tokens produced so far
        self.computed = 0  # tokens in the KV cache (seq_lens_decoder)
        self.target = 0  # prefill ends when computed reaches it; 0 = not prefilling
        self.blocks = [[] for _ in range(num_pools)]
        self.preemptions = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target


@dataclass
class StepRecord:
    """One written step: per request (in batch order) its lengths and block lists.

    ``tables[i]`` holds the block lists of the i-th distinct block size.
    """

    seq_lens_decoder: list
    seq_lens_this_time: list
    seq_lens_encoder: list
    tables: list


@dataclass
class GeneratorStats:
    """What happened over the run (printed by ``trace generate``)."""

    steps: int = 0
    warmup_steps: int = 0
    idle_steps: int = 0
    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    preempted: int = 0
    rejected_queue_full: int = 0
    rejected_too_long: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    max_batch: int = 0
    batch_sum: int = 0
    max_tokens: int = 0
    adjacent_pairs: int = 0
    contiguous_pairs: int = 0
    block_allocations: int = 0
    block_reuses: int = 0
    stopped_early: str | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean_batch"] = round(self.batch_sum / self.steps, 3) if self.steps else 0.0
        d["contiguous_block_fraction"] = (
            round(self.contiguous_pairs / self.adjacent_pairs, 4) if self.adjacent_pairs else None
        )
        return d


class Simulator:
    """The serving loop of the module docstring.

    Parameters
    ----------
    config : GeneratorConfig
    """

    def __init__(self, config: GeneratorConfig):
        self.cfg = config
        self.rng = np.random.default_rng(np.random.SeedSequence(int(config.seed)))
        self.sizes = config.distinct_sizes
        self.pools = [BlockAllocator(config.num_blocks(b)) for b in self.sizes]
        self.waiting: deque = deque()
        self.running: list = []
        self.stats = GeneratorStats()
        self.clock = 0
        self._next_id = 0
        # The most blocks a request may ever need in each pool.
        self._pool_blocks = [p.num_blocks for p in self.pools]

    # -- blocks ----------------------------------------------------------------

    def _grow(self, req: Request, tokens: int) -> bool:
        """Give ``req`` blocks for ``tokens`` tokens in every pool; all or nothing."""
        need = [-(-tokens // b) - len(req.blocks[i]) for i, b in enumerate(self.sizes)]
        if any(n > p.num_free for n, p in zip(need, self.pools)):
            return False
        st = self.stats
        for i, n in enumerate(need):
            if n <= 0:
                continue
            row = req.blocks[i]
            new = self.pools[i].allocate(n)
            prev = row[-1] if row else None
            for blk in new:
                if prev is not None:
                    st.adjacent_pairs += 1
                    st.contiguous_pairs += blk == prev + 1
                prev = blk
            row.extend(new)
        return True

    def _release(self, req: Request) -> None:
        for i, pool in enumerate(self.pools):
            pool.free(reversed(req.blocks[i]))  # the tail first, as vLLM frees
            req.blocks[i] = []

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.computed = 0
        req.target = 0
        req.preemptions += 1
        self.waiting.appendleft(req)
        self.stats.preempted += 1

    # -- one engine step -------------------------------------------------------

    def _arrivals(self) -> None:
        cfg, rng, st = self.cfg, self.rng, self.stats
        for _ in range(int(rng.poisson(cfg.arrival_rate))):
            prompt = cfg.prompt_len.sample(rng)
            output = cfg.output_len.sample(rng)
            st.arrived += 1
            longest = prompt + output + cfg.spec_tokens
            if any(-(-longest // b) > n for b, n in zip(self.sizes, self._pool_blocks)):
                st.rejected_too_long += 1
                continue
            if len(self.waiting) >= cfg.max_waiting:
                st.rejected_queue_full += 1
                continue
            self.waiting.append(Request(self._next_id, self.clock, prompt, output, len(self.sizes)))
            self._next_id += 1

    def _schedule(self) -> list:
        """``[(request, tokens), ...]`` in batch order; allocates the step's blocks."""
        cfg = self.cfg
        budget = cfg.max_batched_tokens
        decode_tokens = 1 + cfg.spec_tokens
        batch = []
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = min(req.target - req.computed, budget) if req.prefilling else decode_tokens
            if n <= 0 or n > budget:
                i += 1
                continue
            scheduled = True
            while not self._grow(req, req.computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    scheduled = False
                    break
            if scheduled:
                batch.append((req, n))
                budget -= n
                i += 1
        if not preempted:
            while self.waiting and len(self.running) < cfg.max_running and budget > 0:
                req = self.waiting[0]
                if not req.prefilling:
                    req.target = req.num_tokens
                n = min(req.target - req.computed, budget)
                if not self._grow(req, req.computed + n):
                    break
                self.waiting.popleft()
                if req.preemptions == 0:
                    self.stats.admitted += 1
                self.running.append(req)
                batch.append((req, n))
                budget -= n
        return batch

    def _advance(self, batch: list) -> None:
        """Apply the step's results: tokens computed, accepted, generated; finish requests."""
        rng, k, p = self.rng, self.cfg.spec_tokens, self.cfg.acceptance
        done = []
        for req, n in batch:
            if req.prefilling:
                req.computed += n
                if req.computed >= req.target:
                    req.target = 0
                    req.generated += 1  # the last chunk samples the next token
            else:
                accepted = 0
                while accepted < k and rng.random() < p:
                    accepted += 1
                req.computed += 1 + accepted
                req.generated += 1 + accepted
            if req.generated >= req.output_len and not req.prefilling:
                done.append(req)
        for req in done:
            self._release(req)
            self.running.remove(req)
            self.stats.finished += 1

    def step(self) -> StepRecord | None:
        """Simulate one engine step; its record, or None when nothing ran."""
        self.clock += 1
        self._arrivals()
        batch = self._schedule()
        if not batch:
            return None
        rec = StepRecord(
            seq_lens_decoder=[r.computed for r, _ in batch],
            seq_lens_this_time=[n for _, n in batch],
            seq_lens_encoder=[n if r.prefilling else 0 for r, n in batch],
            tables=[[list(r.blocks[i]) for r, _ in batch] for i in range(len(self.sizes))],
        )
        self._advance(batch)
        return rec

    def run(self):
        """Yield the written steps' records (``config.steps`` of them, after the warm-up)."""
        cfg, st = self.cfg, self.stats
        idle = 0
        while st.steps < cfg.steps:
            rec = self.step()
            if rec is None:
                st.idle_steps += 1
                idle += 1
                if idle >= MAX_IDLE_STEPS or (cfg.arrival_rate == 0 and not self.waiting and not self.running):
                    st.stopped_early = f"nothing to run for {idle} steps in a row (arrival rate {cfg.arrival_rate:g})"
                    return
                continue
            idle = 0
            if st.warmup_steps < cfg.warmup_steps:
                st.warmup_steps += 1
                continue
            q = rec.seq_lens_this_time
            st.steps += 1
            tokens = sum(q)
            st.tokens += tokens
            st.prefill_tokens += sum(rec.seq_lens_encoder)
            st.batch_sum += len(q)
            st.max_batch = max(st.max_batch, len(q))
            st.max_tokens = max(st.max_tokens, tokens)
            yield rec

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is either free or owned by exactly one request."""
        for i, pool in enumerate(self.pools):
            owner = {}
            for req in list(self.running) + list(self.waiting):
                for blk in req.blocks[i]:
                    assert blk not in owner, f"block {blk} owned by requests {owner[blk]} and {req.rid}"
                    assert not pool.is_free(blk), f"block {blk} of request {req.rid} is on the free list"
                    owner[blk] = req.rid
            free = pool.free_ids()
            assert len(free) == len(set(free)), "a block is on the free list twice"
            assert len(owner) + len(free) == pool.num_blocks, (
                f"{len(owner)} owned + {len(free)} free != {pool.num_blocks} blocks"
            )


def trace_header(config: GeneratorConfig) -> dict:
    """The header fields of a generated trace (without ``kvaddr_trace``)."""
    from kvaddr.measure.environment import kvaddr_version

    header = {"block_sizes": list(config.block_sizes)}
    if config.model:
        header["model"] = config.model
    header["generator"] = config.describe()
    header["kvaddr"] = kvaddr_version()
    return header


def write_trace(config: GeneratorConfig, path: str, progress=None) -> GeneratorStats:
    """Simulate and write a trace to ``path`` (``"-"``: stdout).

    Parameters
    ----------
    progress : callable, optional
        Called with the number of steps written so far, now and then.
    """
    from kvaddr.traces.format import TraceWriter

    sim = Simulator(config)
    sizes = sim.sizes
    per_cache = [sizes.index(b) for b in config.block_sizes]
    with TraceWriter(path, trace_header(config)) as writer:
        for rec in sim.run():
            if len(sizes) == 1:
                tables = rec.tables[0]
            else:
                tables = {"block_tables_per_cache": [rec.tables[i] for i in per_cache]}
            writer.write_step(rec.seq_lens_decoder, rec.seq_lens_this_time, rec.seq_lens_encoder, tables)
            if progress is not None and writer.steps % 64 == 0:
                progress(writer.steps)
    sim.stats.block_allocations = sum(p.allocations for p in sim.pools)
    sim.stats.block_reuses = sum(p.reuses for p in sim.pools)
    if progress is not None:
        progress(sim.stats.steps)
    return sim.stats
