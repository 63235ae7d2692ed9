"""The trace format: writer and streaming reader, the header, bad lines and their line numbers."""

import gzip
import json

import numpy as np
import pytest

from kvaddr.traces.format import BadLine, TraceError, TraceReader, TraceStep, TraceWriter, padded_inputs


def write_lines(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text(
        "".join(
            line if isinstance(line, str) else json.dumps(line)
            for line in (f"{x}\n" if isinstance(x, str) else json.dumps(x) + "\n" for x in lines)
        )
    )
    return str(path)


STEP = {
    "seq_lens_decoder": [5, 0, 9],
    "seq_lens_this_time": [1, 3, 2],
    "seq_lens_encoder": [0, 3, 0],
    "block_tables": [[7, 2], [4], [1, 3, 8]],
}


def read_all(path):
    with TraceReader(path) as r:
        return r.header, list(r)


def test_round_trip_with_header(tmp_path):
    path = str(tmp_path / "t.jsonl")
    with TraceWriter(path, {"block_sizes": [4, 4], "model": "deepseek-v3.2"}) as w:
        w.write_step([5, 0, 9], [1, 3, 2], [0, 3, 0], [[7, 2], [4], [1, 3, 8]])
        w.write_step([6], [1], [0], [[7, 2]])
    header, items = read_all(path)
    assert header.version == 1 and header.block_sizes == (4, 4) and header.model == "deepseek-v3.2"
    assert [type(i) for i in items] == [TraceStep, TraceStep]
    s = items[0]
    assert (s.line, s.index, s.step, s.bsz, s.tokens, s.active, s.width) == (2, 0, 0, 3, 6, 3, 3)
    assert s.seq_lens_decoder.dtype == np.int32 and s.prefill_requests == 1
    assert items[1].line == 3 and items[1].step == 1


def test_padded_inputs_match_the_spec_example(tmp_path):
    """The spec's worked example 1, replayed from a trace line (padded rows are idle)."""
    from kvaddr.reference import step_addressing

    path = write_lines(tmp_path, [STEP])
    _, (s,) = read_all(path)
    b = padded_inputs(s, rows=4, capacity=8, width=4, block_sizes=[4])
    assert b.tables_arg.tolist() == [[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1], [-1, -1, -1, -1]]
    assert b.seq_lens_this_time.tolist() == [1, 3, 2, 0]
    r = step_addressing(b.seq_lens_decoder, b.seq_lens_this_time, b.tables_arg, [4], 8)
    assert r.error_mask == 0
    assert r.outputs.slot_mapping[0].tolist() == [9, 16, 17, 18, 33, 34, -1, -1]
    assert r.outputs.position_ids.tolist() == [5, 0, 1, 2, 9, 10, 0, 0]


def test_header_is_optional_and_blank_lines_count(tmp_path):
    path = write_lines(tmp_path, ["", STEP, "   ", STEP])
    header, items = read_all(path)
    assert header is None
    assert [i.line for i in items] == [2, 4]


def test_seq_lens_encoder_is_optional_and_extra_keys_are_ignored(tmp_path):
    step = {k: v for k, v in STEP.items() if k != "seq_lens_encoder"}
    step["req_ids"] = ["a", "b", "c"]
    _, (s,) = read_all(write_lines(tmp_path, [step]))
    assert s.seq_lens_encoder.tolist() == [0, 0, 0]


def test_block_tables_per_cache_share_equal_tables(tmp_path):
    step = dict(STEP)
    del step["block_tables"]
    step["block_tables_per_cache"] = [STEP["block_tables"], STEP["block_tables"], [[1], [2], [3, 4]]]
    _, (s,) = read_all(write_lines(tmp_path, [step]))
    assert len(s.tables) == 2 and s.cache_table == (0, 0, 1)
    assert s.tables_for(3) == [0, 0, 1]
    with pytest.raises(ValueError, match="3 tables for 2 caches"):
        s.tables_for(2)
    b = padded_inputs(s, 4, 8, 4, [4, 4, 2])
    assert b.block_tables[0] is b.block_tables[1] and b.block_tables[2] is not b.block_tables[0]


@pytest.mark.parametrize(
    "line, words",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"seq_lens_this_time": [1], "block_tables": [[1]]}, "missing 'seq_lens_decoder'"),
        ({**STEP, "seq_lens_this_time": [1, 3]}, "seq_lens_this_time has 2 entries, seq_lens_decoder has 3"),
        ({**STEP, "seq_lens_decoder": [5, -1, 9]}, "seq_lens_decoder[1] = -1 is negative"),
        ({**STEP, "seq_lens_decoder": [5, 1.5, 9]}, "seq_lens_decoder[1] must be an integer"),
        ({**STEP, "seq_lens_decoder": [5, "x", 9]}, "seq_lens_decoder[1] must be an integer"),
        ({**STEP, "seq_lens_encoder": [0, 3]}, "seq_lens_encoder has 2 entries"),
        ({**STEP, "block_tables": [[7, 2], [4]]}, "block_tables has 2 rows"),
        ({**STEP, "block_tables": [[7, 2], 4, [1]]}, "block_tables[1] must be a list"),
        ({**STEP, "block_tables": [[7, 2], [4, "a"], [1]]}, "block_tables[1][1] must be an integer"),
        ({**STEP, "block_tables": [[7, 2], [4, 2**40], [1]]}, "beyond int32"),
        ({**STEP, "block_tables_per_cache": [[[1]]]}, "exactly one of"),
        ({**STEP, "step": "x"}, "step must be an integer"),
        ({**STEP, "seq_lens_decoder": [5, 2**31 - 1, 9]}, "beyond int32"),
        ({"kvaddr_trace": 1}, "header line may only be the first line"),
    ],
)
def test_bad_lines_are_reported_with_their_line_number_and_the_rest_survives(tmp_path, line, words):
    path = write_lines(tmp_path, [{"kvaddr_trace": 1, "block_sizes": [4]}, STEP, line, STEP])
    header, items = read_all(path)
    assert header is not None
    assert [type(i) for i in items] == [TraceStep, BadLine, TraceStep]
    bad = items[1]
    assert bad.line == 3 and words in bad.reason, bad.reason
    assert items[2].line == 4 and items[2].index == 2


def test_a_bad_first_line_is_a_bad_line_not_a_header(tmp_path):
    path = write_lines(tmp_path, ["{oops", STEP])
    header, items = read_all(path)
    assert header is None and isinstance(items[0], BadLine) and items[0].line == 1
    assert items[1].line == 2


def test_non_utf8_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(STEP).encode() + b"\n\xff\xfe\n" + json.dumps(STEP).encode() + b"\n")
    _, items = read_all(str(path))
    assert isinstance(items[1], BadLine) and items[1].line == 2 and "UTF-8" in items[1].reason
    assert isinstance(items[2], TraceStep)


@pytest.mark.parametrize(
    "header, words",
    [
        ({"kvaddr_trace": 99}, "newer than this kvaddr reads"),
        ({"kvaddr_trace": "1"}, "format version"),
        ({"kvaddr_trace": 1, "block_sizes": [0]}, "block_sizes"),
        ({"kvaddr_trace": 1, "block_sizes": 64}, "block_sizes"),
    ],
)
def test_an_unusable_header_is_an_error(tmp_path, header, words):
    with pytest.raises(TraceError, match=words):
        TraceReader(write_lines(tmp_path, [header, STEP]))


def test_missing_file():
    with pytest.raises(TraceError, match="cannot open the trace"):
        TraceReader("/nonexistent/trace.jsonl")


def test_gzip_is_recognised_and_written_reproducibly(tmp_path):
    paths = [str(tmp_path / f"t{i}.jsonl.gz") for i in range(2)]
    for p in paths:
        with TraceWriter(p, {"block_sizes": [4]}) as w:
            w.write_step([5], [1], [0], [[7, 2]])
    data = [open(p, "rb").read() for p in paths]
    assert data[0] == data[1] and data[0][:2] == b"\x1f\x8b"
    assert gzip.decompress(data[0]).startswith(b'{"kvaddr_trace":1')
    header, items = read_all(paths[0])
    assert header.block_sizes == (4,) and items[0].seq_lens_decoder.tolist() == [5]


def test_the_reader_streams(tmp_path):
    """The reader yields the first step having read a small part of a large file."""
    path = tmp_path / "big.jsonl"
    line = (
        json.dumps(
            {"seq_lens_decoder": [100] * 64, "seq_lens_this_time": [1] * 64, "block_tables": [list(range(2))] * 64}
        )
        + "\n"
    )
    with open(path, "w") as fh:
        fh.write(line * 20000)  # about 20 MB
    with TraceReader(str(path)) as r:
        it = iter(r)
        first = next(it)
        assert isinstance(first, TraceStep)
        assert r.bytes_read < r.size / 4
        for _ in range(10):
            next(it)
        assert r.bytes_read < r.size / 4


def test_stdin(tmp_path, monkeypatch):
    import io
    import sys

    data = (json.dumps({"kvaddr_trace": 1, "block_sizes": [4]}) + "\n" + json.dumps(STEP) + "\n").encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    header, items = read_all("-")
    assert header.block_sizes == (4,) and len(items) == 1
