"""kvaddr/constants.py is the one home of shared constants: the copies that must live
elsewhere (kernels.cu's #defines, the public re-exports) agree with it."""

import re

import numpy as np

import kvaddr
from kvaddr import constants
from kvaddr.measure import timing
from kvaddr.outputs import PAD_SLOT_ID
from kvaddr.strategies import cpu, names
from tests.support.kernel_source import expand


def test_max_caches_is_kernels_cu_kv_max_caches():
    found = re.findall(r"^#define KV_MAX_CACHES (\d+)\s*$", expand(), flags=re.M)
    assert found == [str(constants.MAX_CACHES)]


def test_one_block_limit_is_kernels_cu_kv_one_block_max_requests():
    found = re.findall(r"^#define KV_ONE_BLOCK_MAX_REQUESTS (\d+)\s*$", expand(), flags=re.M)
    assert found == [str(constants.ONE_BLOCK_MAX_REQUESTS)] == ["1024"]
    assert constants.REQUEST_LIMITS == {"one-block": 1024}


def test_int32_bounds():
    assert int(np.iinfo(np.int32).max) == constants.INT32_MAX
    assert int(np.iinfo(np.int32).min) == constants.INT32_MIN


def test_reexports_are_the_same_objects():
    assert kvaddr.STRATEGY_NAMES is constants.STRATEGY_NAMES
    assert names.STRATEGY_NAMES is constants.STRATEGY_NAMES and cpu.STRATEGY_NAMES is constants.STRATEGY_NAMES
    assert PAD_SLOT_ID == kvaddr.PAD_SLOT_ID == constants.PAD_SLOT_ID == -1
    assert timing.FLOOR == constants.FLOOR
    assert constants.NUM_STRATEGIES == len(constants.STRATEGY_NAMES) == 5
    assert set(names.DESCRIPTIONS) == set(names.LAUNCHES) == set(constants.STRATEGY_NAMES)
    assert constants.SAVINGS_REFERENCE in constants.STRATEGY_NAMES


def test_the_caches_option_takes_max_caches():
    from click.testing import CliRunner

    from kvaddr import cli as cli_module

    r = CliRunner().invoke(cli_module.cli, ["profile", "--caches", str(constants.MAX_CACHES + 1)])
    assert r.exit_code == 2 and f"1<=x<={constants.MAX_CACHES}" in r.output
