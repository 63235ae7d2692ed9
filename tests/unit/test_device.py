"""The library and `kvaddr info` without a usable GPU.

On this machine CuPy is not installed; to be sure of it wherever the test runs (the GPU machine
has CuPy), "no CuPy" is forced through ``sys.modules``. The CUDA runtime's failures are imitated
with the fake CuPy of :mod:`tests.support.fake_cupy` whose runtime raises as CuPy's does.
"""

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import kvaddr
from kvaddr import cli as cli_module
from kvaddr import device
from kvaddr.errors import KvaddrError
from kvaddr.measure import environment
from kvaddr.strategies.names import STRATEGY_NAMES
from tests.support.fake_cupy import fake_cupy

CPU_HINT = "kvaddr.reference.step_addressing and kvaddr.strategies.cpu run on the CPU"
RAW_NO_DRIVER = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


class CUDARuntimeError(RuntimeError):
    """What cupy_backends.cuda.api.runtime.CUDARuntimeError looks like from outside."""


def failing_cupy(error: str, driver: int = 0, runtime: int = 12040):
    cp = fake_cupy()

    def raise_it():
        raise CUDARuntimeError(error)

    cp.cuda.runtime.getDeviceCount = raise_it
    cp.cuda.runtime.getDevice = raise_it
    cp.cuda.runtime.driverGetVersion = lambda: driver
    cp.cuda.runtime.runtimeGetVersion = lambda: runtime
    return cp


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(device, "_checked", [None, 0])
    monkeypatch.delenv("KVADDR_DEBUG", raising=False)


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ModuleNotFoundError


@pytest.fixture
def no_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", failing_cupy(RAW_NO_DRIVER, driver=0))


def one_sentence(text: str) -> bool:
    return "\n" not in text and text.endswith(".") and text.count("; ") == 1


def planner():
    from kvaddr.planner import StepPlanner

    return StepPlanner(max_requests=4, capacity=8, block_sizes=[4])


# ----------------------------------------------------------------------------- item 2: the library


def test_step_planner_without_cupy_raises_no_cuda_device(no_cupy):
    with pytest.raises(kvaddr.NoCudaDevice) as info:
        kvaddr.StepPlanner(max_requests=4, capacity=8, block_sizes=[4])
    msg = str(info.value)
    assert isinstance(info.value, KvaddrError)
    assert msg.startswith("kvaddr found no usable CUDA device: CuPy is not installed")
    assert CPU_HINT in msg and one_sentence(msg), msg
    assert "ModuleNotFoundError" not in msg  # the raw error only with KVADDR_DEBUG
    assert info.value.reason.startswith("CuPy is not installed") and info.value.raw.startswith("ModuleNotFoundError")


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_gpu_strategies_without_a_driver_raise_no_cuda_device(no_driver, name):
    from kvaddr.strategies import gpu

    with pytest.raises(device.NoCudaDevice, match="no usable CUDA device: no NVIDIA driver; " + CPU_HINT):
        gpu.make_strategy(name, max_requests=4, capacity=8, block_sizes=[4])


def test_no_driver_message_is_plain_and_the_raw_error_is_kept_for_debug(no_driver, monkeypatch):
    with pytest.raises(device.NoCudaDevice) as info:
        planner()
    msg = str(info.value)
    assert msg == f"kvaddr found no usable CUDA device: no NVIDIA driver; {CPU_HINT}."
    assert "insufficient" not in msg and "CUDARuntimeError" not in msg
    monkeypatch.setenv("KVADDR_DEBUG", "1")
    with pytest.raises(device.NoCudaDevice) as info:
        planner()
    assert f"no NVIDIA driver [CUDARuntimeError: {RAW_NO_DRIVER}]" in str(info.value)


@pytest.mark.parametrize(
    "error, driver, present, reason",
    [
        (RAW_NO_DRIVER, 0, None, "no NVIDIA driver"),
        (RAW_NO_DRIVER, 11080, True, "the NVIDIA driver supports CUDA 11.8, older than CuPy's CUDA runtime (12.4)"),
        ("cudaErrorNoDevice: no CUDA-capable device is detected", 12040, True, "the NVIDIA driver sees no GPU"),
        ("cudaErrorNoDevice: no CUDA-capable device is detected", 12040, False, "no NVIDIA driver"),
        ("cudaErrorUnknown: unknown error", 12040, True, "the CUDA runtime failed (cudaErrorUnknown)"),
    ],
)
def test_the_reasons(monkeypatch, error, driver, present, reason):
    monkeypatch.setitem(sys.modules, "cupy", failing_cupy(error, driver=driver))
    monkeypatch.setattr(device, "nvidia_driver_present", lambda: present)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    status = device.cuda_status()
    assert not status.available and status.reason == reason and error in status.raw
    with pytest.raises(
        device.NoCudaDevice, match="no usable CUDA device: " + reason.replace("(", r"\(").replace(")", r"\)")
    ):
        device.require_cuda()


def test_a_broken_cupy_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "cupy":
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return real_import(name, *a, **k)

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    status = device.cuda_status()
    assert status.reason == "CuPy is installed but does not import (KVADDR_DEBUG=1 shows why)"
    assert status.raw == "ImportError: libcudart.so.12: cannot open shared object file"


def test_a_working_gpu_passes_and_is_remembered(monkeypatch):
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    calls = []
    real = cp.cuda.runtime.getDeviceCount
    cp.cuda.runtime.getDeviceCount = lambda: calls.append(1) or real()
    assert device.require_cuda() == 1 and device.require_cuda(0) == 1 and device.require_cuda(np.int32(0)) == 1
    assert len(calls) == 1
    with pytest.raises(device.NoCudaDevice, match="there is no CUDA device 3 \\(the CUDA runtime sees 1"):
        device.require_cuda(3)
    # Another CuPy module (a driver lost, a test's fake) is checked anew.
    monkeypatch.setitem(sys.modules, "cupy", failing_cupy(RAW_NO_DRIVER))
    with pytest.raises(device.NoCudaDevice, match="no NVIDIA driver"):
        device.require_cuda()


def test_the_cpu_path_named_in_the_message_works_without_cupy(no_cupy):
    """What the sentence recommends runs here, on the spec's worked example."""
    from kvaddr.reference import step_addressing
    from kvaddr.strategies.cpu import make_strategy

    dec, q = np.array([5, 0, 9], np.int32), np.array([1, 3, 2], np.int32)
    table = np.array([[7, 2, -1, -1], [4, -1, -1, -1], [1, 3, 8, -1]], np.int32)
    ref = step_addressing(dec, q, table, [4], 8)
    assert ref.outputs.slot_mapping.tolist() == [[9, 16, 17, 18, 33, 34, -1, -1]]
    out = make_strategy("fused", max_requests=3, capacity=8, block_sizes=[4]).step(dec, q, table)
    assert out.slot_mapping.tolist() == [[9, 16, 17, 18, 33, 34, -1, -1]]


# ----------------------------------------------------------------------------- item 3: kvaddr info and --device auto


def info(*args, env=None):
    return CliRunner().invoke(cli_module.cli, ["info", *args], env=env)


def test_info_without_a_driver_says_so_and_shows_no_zero_version(no_driver):
    r = info()
    assert r.exit_code == 0, r.output
    rows = {line.split("  ")[0].strip(): line for line in r.stdout.splitlines()}
    assert rows["CUDA driver"].split()[-1] == "none", r.stdout
    assert "no NVIDIA driver" in rows["CUDA devices"]
    assert "0.0" not in rows["CUDA driver"] and "cudaErrorInsufficientDriver" not in r.stdout
    doc = json.loads(info("--json").stdout)
    assert doc["cuda_driver"] is None and doc["cuda_status"] == "no NVIDIA driver" and doc["cuda_available"] is False


def test_info_with_kvaddr_debug_shows_the_raw_error(no_driver):
    r = info(env={"KVADDR_DEBUG": "1"})
    assert r.exit_code == 0, r.output
    assert "no NVIDIA driver" in r.stdout and "cudaErrorInsufficientDriver" in " ".join(r.stdout.split())


def test_info_without_cupy(no_cupy):
    r = info("--json")
    doc = json.loads(r.stdout)
    assert doc["cupy"] is None and doc["cuda_driver"] is None and doc["cuda_status"].startswith("CuPy is not installed")


def test_profile_auto_without_a_driver_says_why_in_plain_words(no_driver):
    r = CliRunner().invoke(cli_module.cli, ["profile", "--layers", "1", "--budget", "0", "--batch", "4"])
    assert r.exit_code == 0, r.output
    assert "no CUDA device found: no NVIDIA driver; profiling the NumPy strategies on the CPU" in " ".join(
        r.stderr.split()
    )
    r = CliRunner().invoke(cli_module.cli, ["profile", "--device", "cuda", "--batch", "4"])
    assert r.exit_code == 3 and "--device cuda: no CUDA device found: no NVIDIA driver" in r.stderr


def test_environment_probe_uses_the_library_classification(no_driver):
    probe = environment.probe_cuda()
    assert (probe.available, probe.device_count, probe.reason) == (False, 0, "no NVIDIA driver")
    assert environment.cuda_versions()["cuda_driver"] is None
