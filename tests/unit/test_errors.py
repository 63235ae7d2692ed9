"""One exception tree under KvaddrError; the commands, not the data modules, know exit codes."""

import importlib
import inspect
import pkgutil

import pytest

import kvaddr
from kvaddr import errors
from kvaddr.commands import common


def _all_kvaddr_modules():
    for info in pkgutil.walk_packages(kvaddr.__path__, "kvaddr."):
        if info.name.startswith(("kvaddr.torch", "kvaddr.engines")):
            continue  # may need torch or an engine at import time
        yield importlib.import_module(info.name)


def test_every_kvaddr_exception_derives_from_kvaddr_error():
    strays = []
    for module in _all_kvaddr_modules():
        for name, obj in vars(module).items():
            is_ours = inspect.isclass(obj) and obj.__module__.startswith("kvaddr")
            if is_ours and issubclass(obj, BaseException) and not issubclass(obj, errors.KvaddrError):
                strays.append(f"{obj.__module__}.{name}")
    assert not strays, f"exceptions outside the KvaddrError tree: {strays}"


def test_builtin_bases_are_kept():
    assert issubclass(errors.AllocatorError, RuntimeError)
    assert issubclass(errors.ProfileConfigError, ValueError)
    assert issubclass(errors.PlotUnavailable, errors.EnvironmentProblem)
    assert issubclass(errors.BaselineMismatch, errors.BaselineError)
    assert issubclass(errors.StrategyLimitExceeded, ValueError)


def test_strategy_limit_message_names_the_limit_and_the_batch():
    from kvaddr.strategies.names import check_bsz, not_run_reason

    with pytest.raises(errors.StrategyLimitExceeded) as exc:
        check_bsz("one-block", 1025)
    assert str(exc.value) == (
        "one-block runs at most 1024 requests (one block of one thread per request), got bsz=1025"
    )
    assert (exc.value.strategy, exc.value.limit, exc.value.bsz) == ("one-block", 1024, 1025)
    assert check_bsz("one-block", 1024) == 1024 and check_bsz("fused", 10**6) == 10**6
    assert not_run_reason("one-block", 1024) is None and not_run_reason("hoisted", 4096) is None
    assert not_run_reason("one-block", 2048) == "not run: one-block runs at most 1024 requests"


@pytest.mark.parametrize(
    "exc, code",
    [
        (errors.BaselineError("x"), common.EXIT_USAGE),
        (errors.BaselineMismatch("x"), common.EXIT_ENV),
        (errors.BaselineWriteError("x"), common.EXIT_ENV),
        (errors.EnvironmentProblem("x"), common.EXIT_ENV),
        (errors.PlotUnavailable("x"), common.EXIT_ENV),
        (errors.TraceError("x"), common.EXIT_USAGE),
        (errors.ProfileError("x"), common.EXIT_USAGE),
        (errors.ProfileConfigError("x", ("layers",)), common.EXIT_USAGE),
        (RuntimeError("x"), None),
    ],
)
def test_the_commands_map_types_to_exit_codes(exc, code):
    assert common.exit_code_for(exc) == code


def test_data_modules_know_no_exit_codes():
    import kvaddr.gate.baseline_file as bl

    assert not [n for n in vars(bl) if n.startswith("EXIT_")]
    assert not hasattr(bl.BaselineError("x"), "code")
