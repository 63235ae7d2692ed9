"""`kvaddr trace generate`: the simulator, its allocator, determinism by seed, the CLI."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.traces.generator import (
    AllocatorError,
    BlockAllocator,
    Distribution,
    GeneratorConfig,
    Simulator,
    write_trace,
)


def run(*args):
    return CliRunner().invoke(cli_module.cli, list(args))


def small(**kw):
    base = dict(
        steps=300,
        arrival_rate=1.0,
        prompt_len=Distribution.parse("uniform:16:400"),
        output_len=Distribution.parse("uniform:4:60"),
        max_running=24,
        max_batched_tokens=256,
        block_sizes=(16, 16),
        kv_tokens=16 * 96,
        seed=5,
    )
    base.update(kw)
    return GeneratorConfig(**base)


# ----------------------------------------------------------------------------- the allocator


def test_allocator_fifo_reuse_and_no_double_ownership():
    a = BlockAllocator(8)
    first = a.allocate(5)
    assert first == [0, 1, 2, 3, 4] and a.num_free == 3
    assert a.allocate(4) is None and a.num_free == 3  # all or nothing
    a.free([3, 1])
    # Freed blocks go to the back of the free list: 5, 6, 7 first, then 3 and 1.
    assert a.allocate(5) == [5, 6, 7, 3, 1]
    assert a.num_free == 0 and a.reuses == 2 and a.allocations == 10
    with pytest.raises(AllocatorError, match="freed twice"):
        a.free([0, 0])
    with pytest.raises(AllocatorError, match="not in the pool"):
        a.free([8])


def test_every_freed_block_is_reusable():
    a = BlockAllocator(64)
    held = a.allocate(64)
    rng = np.random.default_rng(0)
    freed = [int(b) for b in rng.permutation(held)[:40]]
    a.free(freed)
    again = a.allocate(40)
    assert sorted(again) == sorted(freed) and again == freed  # FIFO: in the order freed
    assert a.allocate(1) is None


# ----------------------------------------------------------------------------- the simulator


def test_invariants_hold_every_step_under_preemption():
    """No block owned twice, owned + free = the pool, blocks cover every scheduled token, limits respected."""
    cfg = small(steps=400)
    sim = Simulator(cfg)
    B = 16
    n = 0
    for rec in sim.run():
        sim.check_invariants()
        n += 1
        q = rec.seq_lens_this_time
        assert 0 < len(q) <= cfg.max_running
        assert 0 < sum(q) <= cfg.max_batched_tokens
        ids = [b for row in rec.tables[0] for b in row]
        assert len(ids) == len(set(ids)), "a block appears in two rows of one step"
        for dec, qq, enc, row in zip(rec.seq_lens_decoder, q, rec.seq_lens_encoder, rec.tables[0]):
            assert len(row) >= math.ceil((dec + qq) / B)
            assert enc in (0, qq)
    assert n == cfg.steps
    assert sim.stats.preempted > 0, "the pool is small enough that preemption must happen"
    assert sim.stats.finished > 0
    assert sum(p.reuses for p in sim.pools) > 0, "freed blocks must be reused"


def test_tables_fragment_over_a_long_run():
    sim = Simulator(small(steps=600, kv_tokens=16 * 400))
    for _ in sim.run():
        pass
    st = sim.stats.as_dict()
    assert st["contiguous_block_fraction"] < 0.9


def test_speculative_tokens_and_acceptance():
    """Decode requests run 1 + K tokens; the sequence grows by 1 + accepted (all of K at 1.0, none at 0.0)."""
    for acceptance, grow in ((1.0, 3), (0.0, 1)):
        sim = Simulator(small(steps=10**6, spec_tokens=2, acceptance=acceptance, arrival_rate=0.2))
        grew = 0
        for _ in range(300):
            before = {r.rid: (r.computed, r.prefilling) for r in sim.running}
            rec = sim.step()
            if rec is None:
                continue
            for q, enc in zip(rec.seq_lens_this_time, rec.seq_lens_encoder):
                assert enc > 0 or q == 3
            for r in sim.running:
                if r.rid in before and not before[r.rid][1]:
                    assert r.computed - before[r.rid][0] in (0, grow)
                    grew += r.computed - before[r.rid][0] == grow
        assert grew > 50


def test_chunked_prefill_respects_the_budget_and_continues():
    sim = Simulator(small(steps=200, prompt_len=Distribution.parse("fixed:600"), max_batched_tokens=128))
    saw_continuation = False
    for rec in sim.run():
        assert sum(rec.seq_lens_this_time) <= 128
        for dec, enc in zip(rec.seq_lens_decoder, rec.seq_lens_encoder):
            saw_continuation |= enc > 0 and dec > 0
    assert saw_continuation


def test_different_block_sizes_get_their_own_tables(tmp_path):
    path = str(tmp_path / "t.jsonl")
    write_trace(small(steps=20, block_sizes=(16, 32, 16)), path)
    lines = open(path).read().splitlines()
    header = json.loads(lines[0])
    assert header["block_sizes"] == [16, 32, 16] and len(header["generator"]["num_blocks"]) == 2
    step = json.loads(lines[1])
    assert "block_tables_per_cache" in step and len(step["block_tables_per_cache"]) == 3
    assert step["block_tables_per_cache"][0] == step["block_tables_per_cache"][2]


def test_a_request_too_long_for_the_pool_is_rejected():
    sim = Simulator(small(steps=5, prompt_len=Distribution.parse("fixed:5000")))
    for _ in range(50):
        assert sim.step() is None
    assert sim.stats.rejected_too_long > 0 and not sim.waiting


# ----------------------------------------------------------------------------- distributions


@pytest.mark.parametrize(
    "spec, lo, hi",
    [
        ("fixed:7", 7, 7),
        ("7", 7, 7),
        ("uniform:3:9", 3, 9),
        ("loguniform:10:1000", 10, 1000),
        ("lognormal:100:0.5", 1, 1 << 24),
        ("lognormal:100:2:300", 1, 300),
    ],
)
def test_distributions_stay_in_range(spec, lo, hi):
    d = Distribution.parse(spec)
    rng = np.random.default_rng(1)
    xs = [d.sample(rng) for _ in range(2000)]
    assert min(xs) >= lo and max(xs) <= hi
    assert Distribution.parse(str(d)) == d


def test_lognormal_median():
    d = Distribution.parse("lognormal:500:0.7")
    rng = np.random.default_rng(2)
    assert 450 < np.median([d.sample(rng) for _ in range(4000)]) < 550


@pytest.mark.parametrize(
    "spec, words",
    [
        ("zipf:3", "unknown distribution"),
        ("uniform:9:3", "LO must be <= HI"),
        ("fixed:0", "must be in"),
        ("lognormal:100", "expected lognormal"),
        ("lognormal:100:x", "SIGMA must be a number"),
        ("uniform:a:3", "must be an integer"),
        ("fixed", "expected fixed"),
    ],
)
def test_distribution_errors(spec, words):
    with pytest.raises(ValueError, match=words):
        Distribution.parse(spec)


# ----------------------------------------------------------------------------- the command


ARGS = [
    "trace",
    "generate",
    "--steps",
    "40",
    "--max-running",
    "16",
    "--prompt-len",
    "uniform:10:300",
    "--output-len",
    "uniform:2:40",
    "--kv-tokens",
    "4096",
    "--arrival-rate",
    "0.8",
]


def test_the_same_seed_gives_the_same_bytes_and_another_seed_differs(tmp_path):
    outs = []
    for i, seed in enumerate((3, 3, 4)):
        path = tmp_path / f"t{i}.jsonl"
        r = run(*ARGS, "--seed", str(seed), "-o", str(path))
        assert r.exit_code == 0, r.output
        assert "wrote 40 steps" in r.stderr
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    stdout = run(*ARGS, "--seed", "3")
    assert stdout.exit_code == 0 and stdout.stdout.encode() == outs[0]


def test_generated_traces_read_back_and_check_against_the_reference(tmp_path):
    from kvaddr.reference import step_addressing
    from kvaddr.traces.format import TraceReader, TraceStep, padded_inputs

    path = str(tmp_path / "t.jsonl.gz")
    r = run(*ARGS, "--spec-tokens", "1", "--block-size", "16", "--warmup-steps", "30", "-o", path)
    assert r.exit_code == 0, r.output
    with TraceReader(path) as reader:
        assert reader.header.block_sizes == (16, 16)
        assert reader.header.meta["generator"]["warmup_steps"] == 30
        n = 0
        for s in reader:
            assert isinstance(s, TraceStep)
            b = padded_inputs(s, s.bsz, s.tokens, max(1, s.width), [16, 16])
            ref = step_addressing(b.seq_lens_decoder, b.seq_lens_this_time, b.tables_arg, [16, 16], s.tokens)
            assert ref.error_mask == 0
            n += 1
    assert n == 40


@pytest.mark.parametrize(
    "args, option",
    [
        (["--steps", "0"], "--steps"),
        (["--prompt-len", "zipf:2"], "--prompt-len"),
        (["--output-len", "uniform:5:1"], "--output-len"),
        (["--acceptance", "1.5"], "--acceptance"),
        (["--arrival-rate", "nan"], "--arrival-rate"),
        (["--max-batched-tokens", "2", "--spec-tokens", "4"], "--max-batched-tokens"),
        (["--block-size", "16,32", "--caches", "3"], "--block-size"),
        (["--kv-tokens", "8", "--block-size", "64"], "--kv-tokens"),
        (["-o", "/nonexistent-dir/t.jsonl"], "--output"),
    ],
)
def test_bad_options_exit_2(args, option):
    r = run("trace", "generate", "--steps", "5", *args)
    assert r.exit_code == 2, r.output
    assert option in r.stderr and "Traceback" not in r.output


def test_no_arrivals_stops_early():
    r = run("trace", "generate", "--steps", "5", "--arrival-rate", "0")
    assert r.exit_code == 0
    assert "stopped early" in r.stderr
