"""How pytest runs these tests: hypothesis profiles, the opt-in toolchain checks, and skips grouped by cause.

Hypothesis profiles (``KVADDR_HYPOTHESIS_PROFILE``): ``dev`` (the default: 30 examples per property,
quick on a laptop), ``ci`` (100 examples, what .ci/run runs) and ``gpu`` (600 examples, the GPU suite).
A test's own ``@settings(max_examples=...)`` wins over the profile.

Toolchain checks (marker ``toolchain``: nvcc compiles kernels.cu, or host programs that lay out its
structs) take minutes, so they run only with ``--run-toolchain`` or ``KVADDR_TOOLCHAIN_TESTS=1``
(.ci/run runs them in a step of their own). A test is one when it carries the marker (a module's
``pytestmark = pytest.mark.toolchain``) or when its code calls its module's ``NVCC``.

Skipped tests are summed up at the end, one line per cause with a count (tests/support/skips.py
words each cause once); ``--list-skips`` lists them one by one as ``-rs`` did.
"""

import collections
import os

import pytest
from hypothesis import HealthCheck, settings

from tests.support import skips

settings.register_profile("dev", deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", deadline=None, max_examples=600, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVADDR_HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    group = parser.getgroup("kvaddr")
    group.addoption(
        "--run-toolchain",
        action="store_true",
        default=False,
        help=f"run the toolchain checks (nvcc; also {skips.TOOLCHAIN_ENV}=1)",
    )
    group.addoption(
        "--list-skips", action="store_true", default=False, help="list every skipped test, not just the causes"
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "toolchain: an nvcc check, opt-in (--run-toolchain)")
    # The grouped summary replaces pytest's per-test skip lines (-rs), unless --list-skips asks for them.
    chars = config.option.reportchars or ""
    if not config.getoption("--list-skips"):
        chars = chars.replace("s", "").replace("S", "")
        if "a" in chars or "A" in chars:  # -ra / -rA include skips: spell out the rest
            chars = chars.replace("a", "fEXxw").replace("A", "fEXxwpP")
    elif "s" not in chars:
        chars += "s"
    config.option.reportchars = chars or "fE"


def _calls_nvcc(item) -> bool:
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    return code is not None and "NVCC" in code.co_names and "NVCC" in getattr(item.module, "__dict__", {})


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(config, items):
    opted_in = skips.toolchain_opted_in(config)
    for item in items:
        if item.get_closest_marker("toolchain") is None and not _calls_nvcc(item):
            continue
        item.add_marker(pytest.mark.toolchain)
        if not opted_in:
            why = skips.TOOLCHAIN_OPT_IN
        elif skips.NVCC is None:
            why = skips.NO_NVCC
        else:
            continue
        # first among the item's skipif marks, so its reason is the one reported
        item.add_marker(pytest.mark.skipif(True, reason=why), append=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = terminalreporter.stats.get("skipped", [])
    if not reports:
        return
    counts = collections.Counter()
    for rep in reports:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason
        counts[skips.cause(reason)] += 1
    terminalreporter.section("skipped, by cause", sep="-")
    for reason, n in counts.most_common():
        terminalreporter.write_line(f"{reason} ({n})")
