"""`kvaddr replay` on the CPU path (and the GPU flow against the fake CuPy), through click's CliRunner."""

import gzip
import json
import re
import sys
import tracemalloc

import numpy as np
import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.measure import environment
from kvaddr.strategies import cpu as cpu_strategies
from kvaddr.traces.format import BadLine, DamagedTrace, NotATraceError, TraceReader, TraceStep, TraceWriter
from kvaddr.traces.generator import Distribution, GeneratorConfig, write_trace
from kvaddr.traces.replay import CpuReplayer, bucket, replay_trace
from kvaddr.traces.report import StreamStats, batch_bin

NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args, **kw):
    return CliRunner().invoke(cli_module.cli, list(args), **kw)


def small_trace(path, steps=60, seed=1, **kw):
    cfg = dict(
        steps=steps,
        arrival_rate=1.0,
        prompt_len=Distribution.parse("uniform:8:300"),
        output_len=Distribution.parse("uniform:2:30"),
        max_running=20,
        max_batched_tokens=256,
        block_sizes=(16, 16),
        kv_tokens=16 * 256,
        seed=seed,
        model="deepseek-v3.2",
    )
    cfg.update(kw)
    write_trace(GeneratorConfig(**cfg), str(path))
    return str(path)


STEP = {
    "seq_lens_decoder": [5, 0, 9],
    "seq_lens_this_time": [1, 3, 2],
    "seq_lens_encoder": [0, 3, 0],
    "block_tables": [[7, 2], [4], [1, 3, 8]],
}


def write_lines(path, objs):
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return str(path)


# ----------------------------------------------------------------------------- the CPU path


def test_replay_reports_the_distribution_and_the_saving_against_batch_size(tmp_path, no_gpu):
    trace = small_trace(tmp_path / "t.jsonl")
    r = run("replay", trace, "--layers", "2", "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 0, r.output
    out = r.stdout
    for word in (
        "per-layer",
        "per-layer-kernel",
        "hoisted",
        "fused",
        "saved mean",
        "p99",
        "total",
        "by batch size (requests running a token), p50 of each bin",
        "per-layer time",
        "fused saved",
        "CPU (NumPy), host wall time:",
    ):
        assert word in out, word
    assert "Traceback" not in r.output and "no CUDA device found" in r.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["kind"] == "kvaddr.replay" and doc["schema_version"] == 1
    t = doc["trace"]
    assert t["steps_replayed"] == t["steps_checked"] == 60 and t["bad_lines"] == 0
    assert t["header"]["block_sizes"] == [16, 16]
    assert doc["workload"]["num_layers"] == 2 and doc["workload"]["block_sizes"] == [16, 16]
    (m,) = doc["measures"]
    assert (m["mode"], m["clock"], m["steps"]) == ("eager", "host", 60)
    names = [s["strategy"] for s in m["strategies"]]
    assert names == ["per-layer", "per-layer-kernel", "hoisted", "one-block", "fused"]
    for s in m["strategies"]:
        assert s["time_us"]["n"] == 60 and s["time_us"]["min"] > 0
        if s["strategy"] == "per-layer":
            assert s["saved_us"] is None
        else:
            for key in ("mean", "p50", "p99", "min", "max", "total"):
                assert s["saved_us"][key] is not None
    assert sum(b["steps"] for b in m["by_batch"]) == 60
    assert all(b["batch_lo"] <= b["batch_hi"] for b in m["by_batch"])
    assert doc["correctness"]["status"] == "passed"


def test_json_to_stdout_is_one_document(tmp_path, no_gpu):
    trace = small_trace(tmp_path / "t.jsonl", steps=10)
    r = run("replay", trace, "--layers", "1", "--json", "-", "--max-steps", "4")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["trace"]["steps_replayed"] == 4 and doc["settings"]["max_steps"] == 4


def test_bad_lines_are_reported_skipped_and_exit_1(tmp_path, no_gpu):
    short = dict(STEP, block_tables=[[7, 2], [4], [1, 3]])  # request 2 needs a third block of 4
    idle = dict(STEP, seq_lens_this_time=[0, 0, 0])
    path = write_lines(
        tmp_path / "t.jsonl", [{"kvaddr_trace": 1, "block_sizes": [4]}, STEP, "{oops", STEP, short, idle, STEP]
    )
    r = run("replay", path, "--layers", "1", "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 1, r.output
    err = " ".join(r.stderr.split())
    assert "line 3: not JSON" in err
    assert "line 5: bad step addressing" in err and "request 2" in err
    assert "2 bad line(s)" in err and "every good line was replayed" in err
    assert "Traceback" not in r.output
    assert "per-layer" in r.stdout  # the report of the good lines is still printed
    doc = json.loads((tmp_path / "r.json").read_text())
    t = doc["trace"]
    assert (t["steps_replayed"], t["bad_lines"], t["idle_steps"], t["lines"]) == (3, 2, 1, 6)
    assert [b["line"] for b in t["bad_line_examples"]] == [3, 5]


def _big_step(bsz):
    return {
        "seq_lens_decoder": [3] * bsz,
        "seq_lens_this_time": [1] * bsz,
        "seq_lens_encoder": [0] * bsz,
        "block_tables": [[i % 50] for i in range(bsz)],
    }


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "fake-gpu"])
def test_steps_over_1024_requests_leave_one_block_out_and_say_so(tmp_path, request, gpu):
    request.getfixturevalue("fake_gpu_arrays" if gpu else "no_gpu")
    path = write_lines(
        tmp_path / "t.jsonl", [{"kvaddr_trace": 1, "block_sizes": [4]}, STEP, _big_step(1500), STEP, _big_step(1500)]
    )
    r = run("replay", path, "--layers", "1", "--eager-every", "1", "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "one-block: not run: one-block runs at most 1024 requests; left out of 2 of 4 steps" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["trace"]["steps_replayed"] == 4
    assert doc["not_run"] == {"one-block": {"steps": 2, "reason": "not run: one-block runs at most 1024 requests"}}
    assert len(doc["measures"]) == (3 if gpu else 1)
    for m in doc["measures"]:
        times = {row["strategy"]: row["time_us"]["n"] for row in m["strategies"]}
        assert times["one-block"] == 2 and times["fused"] == times["per-layer"] == 4, (m["mode"], times)


def test_only_bad_lines(tmp_path, no_gpu):
    # Step lines, every one bad: a trace with nothing to replay (exit 1), not "not a trace" (exit 2).
    path = write_lines(tmp_path / "t.jsonl", [dict(STEP, seq_lens_this_time=[1]), "nope", {"seq_lens_decoder": [1]}])
    r = run("replay", path, "--block-size", "4")
    assert r.exit_code == 1
    assert "no step to replay" in r.stderr and r.stdout == ""
    assert "line 1: seq_lens_this_time has 1 entries" in " ".join(r.stderr.split())


# ----------------------------------------------------------------------------- damaged and foreign files


def gz_trace(tmp_path, steps=200):
    """A gzip trace of ``steps`` good steps (B = 4, one cache) and its bytes."""
    path = tmp_path / "t.jsonl.gz"
    with TraceWriter(str(path), {"block_sizes": [4]}) as w:
        for i in range(steps):
            w.write_step([5 + i % 7, 0, 9], [1, 3, 2], [0, 3, 0], [[7, 2, 11, 12], [4], [1, 3, 8, 9]])
    return path, path.read_bytes()


def test_a_truncated_gzip_trace_replays_what_it_could_read(tmp_path, no_gpu):
    _, data = gz_trace(tmp_path)
    (tmp_path / "trunc.jsonl.gz").write_bytes(data[: len(data) // 2])
    trunc = str(tmp_path / "trunc.jsonl.gz")
    with TraceReader(trunc) as reader:
        items = list(reader)
    good = [i for i in items if not isinstance(i, BadLine)]
    assert 10 < len(good) < 200 and isinstance(items[-1], DamagedTrace)
    assert items[-1].line == good[-1].line + 1 and [type(i) for i in items[:-1]] == [TraceStep] * len(good)
    r = run("replay", trunc, "--layers", "1", "--json", str(tmp_path / "r.json"))
    assert r.exit_code == 1, r.output
    err = " ".join(r.stderr.split())
    assert f"line {items[-1].line}: reading stopped here: the gzip stream ends early or is corrupt" in err
    assert "Compressed file ended" in err and "internal error" not in err and "Traceback" not in r.output
    # the steps before the break were replayed, not skipped
    assert "the steps before it were replayed" in err and "(skipped)" not in err and "were skipped" not in err
    assert f"could not be read past line {items[-1].line - 1}; the {len(good)} good steps before that" in err
    assert "per-layer" in r.stdout and "fused" in r.stdout  # the steps read so far are reported
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["trace"]["steps_replayed"] == len(good) and doc["trace"]["bad_lines"] == 1
    assert doc["trace"]["bad_line_examples"][0]["line"] == items[-1].line


def test_a_gzip_trace_with_a_bad_crc_replays_every_step_and_exits_1(tmp_path, no_gpu):
    path, data = gz_trace(tmp_path, steps=50)
    bad = bytearray(data)
    bad[-8] ^= 0xFF  # the CRC32 of the gzip trailer
    path.write_bytes(bytes(bad))
    r = run("replay", str(path), "--layers", "1", "--json", "-")
    assert r.exit_code == 1, r.output
    assert "CRC check failed" in r.stderr and "line 52: reading stopped here" in " ".join(r.stderr.split())
    assert json.loads(r.stdout)["trace"]["steps_replayed"] == 50


def test_replay_help_gives_the_exit_codes_of_a_damaged_trace():
    text = " ".join(run("replay", "--help").stdout.split())
    exit_text = text.split("Exit status:", 1)[1]
    assert "1 a check failed" in exit_text and "cannot be read to its end (a truncated or corrupt .gz)" in exit_text
    assert "2 usage error" in exit_text and "3 environment problem" in exit_text and "141" in exit_text


def test_replay_graph_mode_without_a_gpu_exits_3(tmp_path, no_gpu):
    trace = small_trace(tmp_path / "t.jsonl", steps=3)
    r = run("replay", trace, "--layers", "1", "--mode", "graph")
    assert r.exit_code == 3 and "--mode graph: CUDA graphs need a GPU" in r.stderr, r.output


def test_a_gzip_stream_damaged_in_its_first_line_exits_2(tmp_path, no_gpu):
    path, data = gz_trace(tmp_path)
    path.write_bytes(data[:20])
    r = run("replay", str(path))
    assert r.exit_code == 2, r.output
    assert "cannot read the trace" in r.stderr and r.stdout == "" and "Traceback" not in r.output


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"


@pytest.mark.parametrize(
    "name, content, why",
    [
        ("empty.jsonl", b"", "the file is empty"),
        ("blank.jsonl", b"\n\n  \n", "only blank lines"),
        ("plot.png", PNG + b"\n" * 40, "binary data"),
        ("plot.png.gz", gzip.compress(PNG * 100, mtime=0), "binary data"),
        ("base.json", json.dumps({"kind": "kvaddr.baseline", "runs": []}, indent=2).encode(), "not JSON"),
        ("one.json", json.dumps({"kind": "kvaddr.baseline", "runs": []}).encode(), "none of a step's keys"),
        ("words.txt", b"nope\n[]\n" * 10, "none of its first 8 non-blank line(s)"),
    ],
)
def test_a_file_that_is_not_a_trace_gets_one_message_and_exit_2(tmp_path, no_gpu, name, content, why):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(NotATraceError, match=re.escape(why)):
        TraceReader(str(path))
    r = run("replay", str(path))
    assert r.exit_code == 2, r.output
    err = " ".join(r.stderr.split())
    assert f"not a kvaddr trace: {path}" in err and why in err, err
    assert err.count("not a kvaddr trace") == 1 and "line 2" not in err and r.stdout == ""


def test_a_baseline_file_is_not_a_trace(tmp_path, no_gpu):
    base = tmp_path / "b.json"
    assert (
        run(
            "profile", "--device", "cpu", "--layers", "1", "--budget", "0", "--batch", "4", "--save", str(base)
        ).exit_code
        == 0
    )
    r = run("replay", str(base))
    assert r.exit_code == 2 and "not a kvaddr trace" in r.stderr and r.stdout == ""


def test_a_few_damaged_lines_before_the_first_step_still_make_a_trace(tmp_path, no_gpu):
    path = write_lines(tmp_path / "t.jsonl", ["{oops", "\x01garbage", {"kvaddr_trace": 1}, STEP, STEP])
    r = run("replay", path, "--layers", "1", "--block-size", "4")
    assert r.exit_code == 1, r.output  # three bad lines (a header is allowed only first), two good steps
    assert "3 bad line(s)" in r.stderr and "per-layer" in r.stdout


def test_a_gzip_trace_on_stdin(tmp_path, no_gpu):
    _, data = gz_trace(tmp_path, steps=5)
    r = run("replay", "-", "--layers", "1", "--json", "-", input=data)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["trace"]["steps_replayed"] == 5


def test_a_trace_without_a_header(tmp_path, no_gpu):
    path = write_lines(tmp_path / "t.jsonl", [STEP, STEP])
    r = run("replay", path, "--layers", "1")
    assert r.exit_code == 0, r.output  # B = 64 assumed (the preset's): every position is in the first block
    assert "no header line" in r.stderr and "assuming B = 64" in r.stderr
    r = run("replay", path, "--layers", "1", "--block-size", "4", "--json", "-")
    assert r.exit_code == 0, r.output
    assert "no header line" not in r.stderr
    assert json.loads(r.stdout)["workload"]["block_sizes"] == [4, 4]


def test_stdin(tmp_path, no_gpu):
    trace = small_trace(tmp_path / "t.jsonl", steps=5)
    r = run("replay", "-", "--layers", "1", "--json", "-", input=open(trace, "rb").read())
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["trace"]["steps_replayed"] == 5


def test_a_wrong_output_stops_the_replay_naming_the_line(tmp_path, monkeypatch, no_gpu):
    real = cpu_strategies.make_strategy

    class Wrong:
        def __init__(self, inner):
            self.inner, self.name = inner, inner.name

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self, *a, **k):
            out = self.inner.step(*a, **k)
            out.slot_mapping = out.slot_mapping.copy()
            out.slot_mapping[0, 0] += 1
            return out

    monkeypatch.setattr(
        cpu_strategies,
        "make_strategy",
        lambda name, **kw: Wrong(real(name, **kw)) if name == "hoisted" else real(name, **kw),
    )
    trace = small_trace(tmp_path / "t.jsonl", steps=5)
    r = run("replay", trace, "--layers", "1")
    assert r.exit_code == 1
    assert "'hoisted'" in r.stderr and "trace line 2" in r.stderr and "slot_mapping" in r.stderr
    assert r.stdout == "" and "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["/nonexistent/t.jsonl"], 2, "cannot open the trace"),
        (["TRACE", "--caches", "3"], 2, "--caches"),
        (["TRACE", "--device", "cuda"], 3, "--device cuda"),
        (["TRACE", "--check-every", "0"], 2, "--check-every"),
        (["TRACE", "--json", "/nonexistent-dir/r.json"], 2, "--json"),
    ],
)
def test_usage_and_environment_errors(tmp_path, no_gpu, args, code, words):
    trace = small_trace(tmp_path / "t.jsonl", steps=3)
    r = run("replay", *[trace if a == "TRACE" else a for a in args])
    assert r.exit_code == code, r.output
    assert words in r.stderr and "Traceback" not in r.output and r.stdout == ""


def test_both_modes_on_the_cpu_say_that_eager_runs(tmp_path, no_gpu):
    trace = small_trace(tmp_path / "t.jsonl", steps=3)
    r = run("replay", trace, "--layers", "1", "--mode", "both")
    assert r.exit_code == 0 and "graph mode needs a CUDA device" in r.stderr


def test_replay_with_a_profile(tmp_path, no_gpu):
    trace = small_trace(tmp_path / "t.jsonl", steps=3)
    r = run("replay", trace, "--profile", "glm-5", "--layers", "1", "--json", "-")
    assert r.exit_code == 0, r.output
    w = json.loads(r.stdout)["workload"]
    assert w["model"] == "glm-5" and w["block_sizes"] == [16, 16]  # the header's B beat the profile's


# ----------------------------------------------------------------------------- bounded memory


def test_stream_stats_are_bounded_and_exact_while_they_fit():
    s = StreamStats(capacity=100)
    for x in range(50):
        s.add(float(x))
    assert s.exact and s.quantile(50) == 24.5
    for x in range(50, 100_000):
        s.add(float(x))
    assert not s.exact and len(s._res) == 100
    assert s.n == 100_000 and s.min == 0 and s.max == 99_999 and s.total == sum(range(100_000))
    assert 30_000 < s.quantile(50) < 70_000


def test_replay_memory_does_not_grow_with_the_trace(tmp_path):
    short = small_trace(tmp_path / "a.jsonl", steps=40, seed=2, max_running=6)
    long = small_trace(tmp_path / "b.jsonl", steps=400, seed=2, max_running=6)

    def peak(path):
        replayer = CpuReplayer(1, [16, 16])
        tracemalloc.start()
        with TraceReader(path) as reader:
            stats = replay_trace(reader, replayer, [16, 16], check_every=100)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top, stats

    a, sa = peak(short)
    b, sb = peak(long)
    assert sb.steps == 10 * sa.steps
    assert b < a + 2_000_000, (a, b)  # 10x the steps: the peak grows by well under 2 MB (one reservoir)


def test_buckets_and_bins():
    assert [bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert bucket(3, 8) == 8
    assert [batch_bin(n) for n in (1, 2, 3, 4, 7, 8, 4096)] == [
        (1, 1),
        (2, 3),
        (2, 3),
        (4, 7),
        (4, 7),
        (8, 15),
        (4096, 8191),
    ]


# ----------------------------------------------------------------------------- the GPU flow (fake CuPy)


class _DeviceArray(np.ndarray):
    def set(self, arr, stream=None):
        np.copyto(self, arr)


@pytest.fixture
def fake_gpu_arrays(fake_gpu):
    cp = sys.modules["cupy"]
    cp.empty = lambda shape, dtype=np.float64: np.empty(shape, dtype).view(_DeviceArray)
    return fake_gpu


def test_gpu_replay_both_modes(tmp_path, fake_gpu_arrays):
    trace = small_trace(tmp_path / "t.jsonl", steps=12)
    r = run("replay", trace, "--layers", "1", "--eager-every", "3", "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["environment"]["device"] == "cuda" and doc["settings"]["modes"] == ["eager", "graph"]
    steps = {(m["mode"], m["clock"]): m["steps"] for m in doc["measures"]}
    assert steps == {("graph", "gpu"): 12, ("eager", "host"): 4, ("eager", "gpu"): 4}
    shapes = len(doc["trace"]["padded_shapes"])
    assert doc["settings"]["captured_shapes"] == 5 * shapes  # every strategy, one-block included
    assert len(doc["headlines"]) == 3


def test_gpu_replay_catches_a_graph_that_skips_work(tmp_path, fake_gpu_arrays):
    fake_gpu_arrays["noop"].add("fused")
    trace = small_trace(tmp_path / "t.jsonl", steps=6)
    r = run("replay", trace, "--layers", "1", "--mode", "graph")
    assert r.exit_code == 1, r.output
    assert "'fused'" in r.stderr and "graph replay" in r.stderr and "trace line" in r.stderr
    assert r.stdout == ""


def test_gpu_replay_eager_alone_runs_every_step(tmp_path, fake_gpu_arrays):
    trace = small_trace(tmp_path / "t.jsonl", steps=7)
    r = run("replay", trace, "--layers", "1", "--mode", "eager", "--eager-every", "3", "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert {(m["mode"], m["clock"]): m["steps"] for m in doc["measures"]} == {("eager", "host"): 7, ("eager", "gpu"): 7}
    assert doc["settings"]["captured_shapes"] == 0 and doc["trace"]["steps_checked"] == 7
