"""``kvaddr profile --engine vllm`` on a real GPU: the command checks, times and reports both
implementations (a short budget: this is the flow, not the measurement)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvaddr import cli as cli_module
from tests.support.gpu import requires_gpu

pytestmark = requires_gpu

ARGS = [
    "profile",
    "--engine",
    "vllm",
    "--device",
    "cuda",
    "--batch",
    "64",
    "--shape",
    "mixed:64:1024",
    "--groups",
    "16,64",
    "--dummy-fraction",
    "0.1",
    "--input-sets",
    "2",
    "--budget",
    "0.02",
]


def test_vllm_engine_profile_json_on_the_gpu():
    r = CliRunner().invoke(cli_module.cli, [*ARGS, "--json", "-"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kind"] == "kvaddr.profile.vllm" and doc["options"]["engine"] == "vllm"
    assert doc["environment"]["device"] == "cuda" and doc["environment"]["gpu"] is not None
    assert [s["shape"] for s in doc["shapes"]] == ["decode:64", "mixed:64:1024"]
    for shape in doc["shapes"]:
        assert shape["correctness"]["status"] == "passed"
        savings = {(v["mode"], v["clock"]): v for v in shape["savings"]}
        assert set(savings) == {("graph", "gpu"), ("eager", "host"), ("eager", "gpu")}
        for v in savings.values():
            assert v["one_launch_us"] > 0 and v["three_launch_us"] > 0
        # three launches cannot beat one in graph mode by more than noise
        assert savings[("graph", "gpu")]["verdict"] in ("saving", "within noise")


def test_vllm_engine_profile_tables_with_dcp_on_the_gpu():
    args = [a if a != "16,64" else "64" for a in ARGS]
    r = CliRunner().invoke(cli_module.cli, [*args, "--dcp", "2:1:16", "--mode", "graph"])
    assert r.exit_code == 0, r.output
    assert "DCP 2 ranks (rank 1, interleave 16)" in r.stdout
    assert r.stdout.count("graph: GPU: one launch ") == 2
