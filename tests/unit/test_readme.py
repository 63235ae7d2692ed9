"""README.md is the product's front page and the package's long description: short, in a fixed
order, with its commands right and its snippets runnable. The CPU snippet runs here as written;
the GPU snippets must parse and name only existing public names (they run on a GPU in
tests/gpu/test_readme_quickstart_gpu.py)."""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re

import pytest

import kvaddr
from tests.support.docs import README, expected_prints, resolve, snippet, snippet_names

TEXT = README.read_text(encoding="utf-8")
GPU_SNIPPETS = ("cupy", "torch", "vllm")

#: README's sections, in this order.
SECTIONS = [
    "Requirements",
    "Install",
    "Two commands",
    "Quickstart",
    "Command line",
    "Regression gate in CI",
    "Documentation",
    "Contributing, changes, license",
]


def headings(level: str = "## ") -> list:
    return [line[len(level) :].strip() for line in TEXT.splitlines() if line.startswith(level)]


def test_readme_is_at_most_250_lines():
    assert len(TEXT.splitlines()) <= 250


def test_sections_in_order():
    assert headings() == SECTIONS


def test_quickstart_order_cpu_then_cupy_then_torch_then_vllm():
    assert snippet_names(TEXT) == ["cpu", *GPU_SNIPPETS]
    quick = headings("### ")
    assert [h.split(":")[0] for h in quick[:4]] == [
        "On the CPU",
        "On the GPU with CuPy",
        "From PyTorch",
        "For vLLM",
    ]


def test_cpu_reader_meets_the_numpy_snippet_before_cupy():
    assert TEXT.index("<!-- snippet: cpu -->") < TEXT.index("import cupy")


def test_the_two_commands_are_there_verbatim():
    assert "python -m pip install '.[cuda12]' && kvaddr profile --batch 64" in TEXT
    assert "python -m pip install '.[test,plot]' && pytest -q" in TEXT
    two = TEXT[TEXT.index("## Two commands") : TEXT.index("## Quickstart")]
    assert "cuda13" in two and "'.[test,plot,cuda12]'" in two


def test_install_names_both_cuda_extras_and_the_cpu_install():
    install = TEXT[TEXT.index("## Install") : TEXT.index("## Two commands")]
    assert "'.[cuda12]'" in install and "'.[cuda13]'" in install and "pip install .\n" in install.replace("   ", "\n")
    assert "kvaddr profile --batch 64" in install


def test_first_call_and_test_time_are_stated_with_date_and_machine():
    install = TEXT[TEXT.index("## Install") : TEXT.index("## Two commands")]
    assert "H200" in install and "2026-" in install and "cold" in install
    two = TEXT[TEXT.index("## Two commands") : TEXT.index("## Quickstart")]
    assert "minutes on two cores" in two and "2026-" in two
    assert "MEASURE" not in TEXT


def test_cpu_timings_are_said_to_be_the_numpy_strategies():
    assert "CPU timings are the NumPy strategies', not the kernels'" in TEXT


def test_the_pitch_figures_carry_date_machine_and_commit():
    pitch = TEXT[: TEXT.index("## Requirements")]
    assert "H200" in pitch
    for date_and_commit in re.findall(r"2026-\d\d-\d\d, (?:kvaddr at )?commit [0-9a-f]{7}", pitch):
        assert date_and_commit
    assert len(re.findall(r"commit [0-9a-f]{7}", pitch)) >= 3
    assert "docs/sweep-h200.png" in pitch and "docs/benchmarks.md" in pitch


def test_the_gate_section_links_its_page():
    gate = TEXT[TEXT.index("## Regression gate in CI") : TEXT.index("## Documentation")]
    assert "docs/ci-gate.md" in gate and "kvaddr check --baseline" in gate


def test_cpu_snippet_runs_and_prints_what_it_says():
    code = snippet(TEXT, "cpu")
    assert "cupy" not in code and "torch" not in code
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    got = [line.strip() for line in buf.getvalue().splitlines()]
    assert got == expected_prints(code, explanations=False)
    assert len(got) >= 4


def _kvaddr_names(code: str) -> list:
    """Every kvaddr name a snippet uses: imports, dotted ``kvaddr.x`` chains, and attributes
    read on variables bound to a kvaddr class's instance."""
    tree = ast.parse(code)
    names, aliases, instances = [], {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvaddr":
            for a in node.names:
                names.append(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kvaddr":
                    names.append(a.name)
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "kvaddr"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1:
            func = ast.unparse(node.value.func)
            head = func.split(".")[0]
            if head in aliases and isinstance(node.targets[0], ast.Name):
                full = aliases[head] + func[len(head) :]
                if full.split(".")[-1][:1].isupper():  # a class: its instance
                    instances[node.targets[0].id] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = ast.unparse(node)
            head = chain.split(".")[0]
            if head in aliases and "(" not in chain and "[" not in chain:
                names.append(aliases[head] + chain[len(head) :])
            elif head in instances and isinstance(node.value, ast.Name):
                names.append(f"{instances[head]}.{node.attr}")
    return sorted(set(names))


@pytest.mark.parametrize("name", GPU_SNIPPETS)
def test_gpu_snippets_parse_and_name_only_existing_public_names(name):
    code = snippet(TEXT, name)
    used = _kvaddr_names(code)
    assert used, name
    for dotted in used:
        assert not any(part.startswith("_") for part in dotted.split(".")), dotted
        assert resolve(dotted), f"README's {name} snippet names {dotted}, which does not exist"


def test_snippets_use_the_bound_launch_where_the_brief_says():
    assert "planner.bind(" in snippet(TEXT, "vllm") and "bound.launch(" in snippet(TEXT, "vllm")
    assert "kvaddr.torch.step(" in snippet(TEXT, "torch")
    assert "StepPlanner(" in snippet(TEXT, "cupy")


def _public_signature(obj) -> str:
    import importlib.util

    from tests.support.docs import ROOT

    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "scripts" / "gen_api_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen.signature_text(obj)


def test_readme_states_step_planners_signature():
    from kvaddr.planner import StepPlanner

    sig = _public_signature(StepPlanner)
    stated = re.search(r"`StepPlanner(\(max_requests.*?\))`", " ".join(TEXT.split()))
    assert stated, "README states StepPlanner's signature"
    assert stated.group(1) == sig
    assert "attention=None" in sig and "kv_indices_capacity=None" in sig


def test_kvaddr_version_is_the_release_and_the_cli_agrees():
    from click.testing import CliRunner

    from kvaddr import cli as cli_module

    assert kvaddr.__version__ == "0.2.0"
    result = CliRunner().invoke(cli_module.cli, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kvaddr {kvaddr.__version__}"
    changelog = (README.parent / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{kvaddr.__version__}] - " in changelog


def test_init_docstring_names_only_attributes_that_exist():
    doc = inspect.getdoc(kvaddr)
    public = doc[doc.index("Public API") : doc.index("Modules imported by name")]
    for line in public.splitlines()[2:]:
        names = line.split("  ")[0]
        for word in re.findall(r"[A-Za-z_]+", names):
            assert hasattr(kvaddr, word), word
    for name in kvaddr.__all__:
        assert hasattr(kvaddr, name), name
    assert "cpu_strategies" not in doc
    with pytest.raises(AttributeError):
        kvaddr.cpu_strategies  # noqa: B018
