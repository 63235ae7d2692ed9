"""``kvaddr profile --dsa`` on the GPU (kvaddr.measure.dsa_profile): both designs' metadata and
conversions checked against the NumPy references, then timed, at 1 and 64 decode requests and a
batch that is not a power of two; the command prints the report. Skips, with the reason,
without a GPU."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.support.gpu import requires_gpu

pytestmark = requires_gpu


def test_rows_are_checked_and_timed():
    from kvaddr.measure import dsa_profile

    rows = dsa_profile.run_dsa_profile([1, 64, 100], layers=3, copies=3, replays=2, max_ctx=4000)
    assert [r.batch for r in rows] == [1, 64, 100]
    for r in rows:
        assert r.metadata_per_layer_design_us > 0 and r.conversion_per_layer_us > 0 and r.conversion_kvaddr_us > 0
        assert r.kvaddr_us == r.metadata_kvaddr_us + 3 * r.conversion_kvaddr_us


def test_command_prints_the_report(tmp_path):
    from kvaddr import cli

    path = tmp_path / "dsa.json"
    r = CliRunner().invoke(
        cli.cli,
        ["profile", "--model", "deepseek-v3.2", "--dsa", "--batch", "64", "--layers", "61", "--json", str(path)],
    )
    assert r.exit_code == 0, r.output
    assert "per decode step" in r.output
    doc = json.loads(path.read_text())
    assert doc["dsa"][0]["batch"] == 64 and doc["dsa"][0]["layers"] == 61
