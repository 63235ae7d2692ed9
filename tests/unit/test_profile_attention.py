"""``kvaddr profile --attention`` on the CPU path (CliRunner) and the profiler's pieces:
the option is a ProfileConfig setting, every strategy produces the metadata, the
correctness check compares it, and kv_indices_capacity defaults to the workload's bound."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvaddr import cli as cli_module
from kvaddr.errors import ProfileConfigError
from kvaddr.measure import environment
from kvaddr.measure.correctness import SENTINEL, compare_outputs, poison
from kvaddr.measure.profile_run import AttentionSetting, ProfileConfig, kv_indices_bound, references
from kvaddr.measure.workload import make_input_sets
from kvaddr.outputs import AttentionOutputs, StepOutputs
from kvaddr.strategies import cpu as cpu_strategies

FAST = ["--layers", "2", "--budget", "0", "--batch", "4", "--input-sets", "2"]
NO_GPU = environment.CudaProbe(False, 0, "CuPy is not importable (test)")


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(environment, "probe_cuda", lambda: NO_GPU)


def run(*args):
    return CliRunner().invoke(cli_module.cli, list(args))


def test_profile_with_attention_records_it_and_checks_every_strategy(monkeypatch):
    seen = []
    real = cpu_strategies.make_strategy

    def spy(name, **kw):
        seen.append((name, kw.get("attention"), kw.get("kv_indices_capacity")))
        return real(name, **kw)

    monkeypatch.setattr(cpu_strategies, "make_strategy", spy)
    r = run("profile", *FAST, "--caches", "2", "--attention", "flashinfer,varlen,page_table", "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["options"]["attention"] == ["flashinfer", "varlen", "page_table"]
    assert doc["options"]["kv_indices_capacity"] is None  # the default: the workload's bound
    assert {n for n, _, _ in seen} == set(cpu_strategies.STRATEGY_NAMES)
    groups = {a for _, a, _ in seen}
    assert groups == {("flashinfer", "varlen", "page_table")}
    caps = {c for _, _, c in seen}
    assert len(caps) == 1 and next(iter(caps)) >= 1


def test_profile_without_attention_passes_nothing(monkeypatch):
    seen = []
    real = cpu_strategies.make_strategy

    def spy(name, **kw):
        seen.append(kw)
        return real(name, **kw)

    monkeypatch.setattr(cpu_strategies, "make_strategy", spy)
    r = run("profile", *FAST, "--json", "-")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["options"]["attention"] == []
    assert all("attention" not in kw for kw in seen)


def test_profile_attention_explicit_capacity_too_small_fails_the_check():
    # N = 1 cannot hold the metadata: the reference sets bit 16, a workload error (exit 1)
    r = run("profile", *FAST, "--attention", "flashinfer", "--kv-indices-capacity", "1")
    assert r.exit_code == 1
    assert "error bits 16" in r.stderr or "bad addresses" in r.stderr


@pytest.mark.parametrize(
    "args, option",
    [
        (["--attention", "flash"], "--attention"),
        (["--kv-indices-capacity", "0", "--attention", "flashinfer"], "--kv-indices-capacity"),
        (["--kv-indices-capacity", "8"], "--kv-indices-capacity"),
    ],
)
def test_bad_attention_options_exit_2_naming_the_option(args, option):
    r = run("profile", *FAST, *args)
    assert r.exit_code == 2, r.output
    assert option in r.stderr


def test_a_wrong_kv_indices_entry_exits_1(monkeypatch):
    real = cpu_strategies.make_strategy

    class Wrapped:
        def __init__(self, s):
            self.s = s
            self.launches_per_step = s.launches_per_step

        def step(self, *a, **kw):
            out = self.s.step(*a, **kw)
            out.attention.kv_indices = out.attention.kv_indices.copy()
            out.attention.kv_indices[0, 1] += 1
            return out

        def check(self, stream=None):
            self.s.check(stream)

    monkeypatch.setattr(
        cpu_strategies,
        "make_strategy",
        lambda name, **kw: Wrapped(real(name, **kw)) if name == "hoisted" else real(name, **kw),
    )
    r = run("profile", *FAST, "--attention", "flashinfer")
    assert r.exit_code == 1
    assert "'hoisted'" in r.stderr and "attention.kv_indices" in r.stderr and "index (0, 1)" in r.stderr


def test_config_setting_and_replay():
    c = ProfileConfig(attention="varlen,flashinfer")
    c.validate()
    rec = ProfileConfig(attention=("flashinfer", "varlen"), kv_indices_capacity=100).recorded_options()
    assert rec["attention"] == ["flashinfer", "varlen"] and rec["kv_indices_capacity"] == 100
    again = ProfileConfig.from_recorded(rec)
    assert again.attention == ("flashinfer", "varlen") and again.kv_indices_capacity == 100
    with pytest.raises(ProfileConfigError) as e:
        ProfileConfig(attention=("nope",)).validate()
    assert e.value.fields == ("attention",)
    with pytest.raises(ProfileConfigError) as e:
        ProfileConfig(attention=("varlen",), kv_indices_capacity=5).validate()
    assert "kv_indices_capacity" in e.value.fields


def test_kv_indices_bound_is_the_largest_cache_need():
    c = ProfileConfig(batches=(8,), caches=2, block_sizes=(16, 64), input_sets=3, context=(100, 5000))
    batches = make_input_sets(c.workload(), 8)
    want = 0
    for b in batches:
        L = b.seq_lens_decoder.astype(np.int64) + b.seq_lens_this_time
        want = max(want, int(np.ceil(L / 16).sum()))  # the smaller B needs more pages
    assert kv_indices_bound(batches) == want
    refs = references(batches, AttentionSetting(("flashinfer",)))
    for r in refs:  # no overflow at the bound, and some set fills it exactly
        assert r.attention.kv_indices.shape[1] == want
    assert any((r.attention.kv_indices[0] >= 0).all() for r in refs)


def test_compare_and_poison_cover_the_attention_outputs():
    att = AttentionOutputs(
        kv_indptr=np.array([[0, 2]], np.int32),
        kv_indices=np.array([[3, 4, -1]], np.int32),
        kv_last_page_len=np.array([[5]], np.int32),
        cu_seqlens_k=np.array([0, 9], np.int32),
        max_seqlen_q=np.array(1, np.int32),
        max_seqlen_k=np.array(9, np.int32),
        page_table=(np.array([[3, 4]], np.int32),),
    )

    def outputs(a):
        z = np.zeros(1, np.int32)
        return StepOutputs(z, np.array(1, np.int32), z, z.astype(np.int64), z, np.zeros((1, 1), np.int64), a)

    import copy

    assert compare_outputs("s", "ctx", outputs(copy.deepcopy(att)), outputs(att)) is None
    bad = copy.deepcopy(att)
    bad.kv_indices[0, 2] = 7
    m = compare_outputs("s", "ctx", outputs(bad), outputs(att))
    assert m is not None and m.output == "attention.kv_indices" and m.got == 7 and m.expected == -1
    bad = copy.deepcopy(att)
    bad.max_seqlen_k = np.array(8, np.int32)
    assert compare_outputs("s", "ctx", outputs(bad), outputs(att)).output == "attention.max_seqlen_k"
    bad = copy.deepcopy(att)
    bad.page_table = (np.array([[3, 5]], np.int32),)
    assert compare_outputs("s", "ctx", outputs(bad), outputs(att)).output == "attention.page_table[0]"
    assert compare_outputs("s", "ctx", outputs(None), outputs(att)).output == "attention"
    o = outputs(copy.deepcopy(att))
    poison(o)
    a = o.attention
    for arr in (a.kv_indptr, a.kv_indices, a.kv_last_page_len, a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k):
        assert (np.asarray(arr) == SENTINEL).all()
    assert a.page_table[0].tolist() == [[3, 4]]  # a view of the inputs: never poisoned
