"""A malformed launch variable (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) is refused by
``init_distributed`` with one line naming the variable and its value, before any socket or store is
opened: unchecked, it surfaced as a bare ``int()`` error or a C++ rendezvous timeout.

No test here creates a process group: the validator is called directly, and the one test through
``init_distributed`` replaces torch's rendezvous with a function that fails if it is ever reached.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import slipstream.comm.distributed as distributed
from slipstream.comm.distributed import LaunchEnvError, check_launch_env
from slipstream.comm.process import PROCESS
from slipstream.utils.logging import current_rank

VALID = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
LAUNCH_KEYS = tuple(VALID)

# (overrides of VALID, what the one-line error must say)
BAD = {
    "WORLD_SIZE not a number": (
        {"WORLD_SIZE": "abc"},
        "WORLD_SIZE='abc': must be a positive integer (the number of processes)",
    ),
    "WORLD_SIZE zero": ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE='0': must be a positive integer"),
    "WORLD_SIZE negative": ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1': must be a positive integer"),
    "WORLD_SIZE empty": ({"WORLD_SIZE": ""}, "WORLD_SIZE='': must be a positive integer"),
    "WORLD_SIZE superscript digit": ({"WORLD_SIZE": "²"}, "WORLD_SIZE='²': must be a positive integer"),
    "WORLD_SIZE thousands of digits": ({"WORLD_SIZE": "9" * 5000}, "WORLD_SIZE='999"),
    "RANK not a number": ({"RANK": "abc"}, "RANK='abc': must be a non-negative integer (this process's rank)"),
    "RANK negative": ({"RANK": "-1"}, "RANK='-1': must be a non-negative integer"),
    "RANK equal to WORLD_SIZE": ({"RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2: ranks run from 0 to 1"),
    "RANK above WORLD_SIZE": ({"RANK": "7"}, "RANK=7 is not below WORLD_SIZE=2"),
    "LOCAL_RANK negative": ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1': must be a non-negative integer"),
    "LOCAL_RANK not a number": ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc': must be a non-negative integer"),
    "MASTER_PORT not a number": ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc': must be an integer in 1..65535"),
    "MASTER_PORT zero": ({"MASTER_PORT": "0"}, "MASTER_PORT='0': must be an integer in 1..65535"),
    "MASTER_PORT negative": ({"MASTER_PORT": "-1"}, "MASTER_PORT='-1': must be an integer in 1..65535"),
    "MASTER_PORT too large": ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999': must be an integer in 1..65535"),
    "MASTER_ADDR empty": ({"MASTER_ADDR": ""}, "MASTER_ADDR='': must be rank 0's host name or IP address"),
    "MASTER_ADDR blank": ({"MASTER_ADDR": "  "}, "MASTER_ADDR='  ': must be rank 0's host name or IP address"),
}


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch):
    """Set the launch variables (VALID with overrides) through monkeypatch; returns the setter."""
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)

    def set_env(overrides: dict[str, str] | None = None) -> None:
        for key, value in {**VALID, **(overrides or {})}.items():
            monkeypatch.setenv(key, value)

    return set_env


@pytest.mark.parametrize("overrides, expected", BAD.values(), ids=BAD.keys())
def test_bad_launch_variable_is_one_line_naming_it(launch_env, overrides, expected) -> None:
    launch_env(overrides)
    with pytest.raises(LaunchEnvError) as err:
        check_launch_env(os.environ)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message and len(message) < 300  # one line, even for 5000 digits


def test_missing_variable_is_named() -> None:
    env = {k: v for k, v in VALID.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(LaunchEnvError, match="environment variables MASTER_ADDR, MASTER_PORT are not set"):
        check_launch_env(env)


@pytest.mark.parametrize(
    "env",
    [
        VALID,
        dict(VALID, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT="1"),
        dict(VALID, MASTER_PORT="65535", MASTER_ADDR="node-a.cluster"),
        dict(VALID, WORLD_SIZE=" 2\n"),  # torch's own int() takes surrounding whitespace too
        {},  # a laptop: a single-process group, nothing to check
        {"LOCAL_RANK": "0"},
    ],
    ids=["two ranks", "one rank", "edge port", "whitespace", "nothing set", "local rank alone"],
)
def test_valid_launch_variables_pass(env) -> None:
    check_launch_env(env)


def test_init_distributed_refuses_before_any_rendezvous(launch_env, monkeypatch) -> None:
    # Pretend no group exists (a group made by an earlier test would skip the set-up) and make any
    # attempt to open a store or join a group fail loudly.
    launch_env({"MASTER_PORT": "99999"})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    def rendezvous(*args, **kwargs):
        raise AssertionError("a store or process group was created before the environment was checked")

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(PROCESS, "timeout", PROCESS.timeout)  # init_distributed records its timeout
    monkeypatch.setattr(distributed.dist, "init_process_group", rendezvous)
    monkeypatch.setattr(distributed.dist, "TCPStore", rendezvous)
    with pytest.raises(LaunchEnvError, match=r"^MASTER_PORT='99999': must be an integer in 1\.\.65535"):
        distributed.init_distributed()


def test_local_rank_beyond_the_cuda_devices_is_named(launch_env, monkeypatch) -> None:
    launch_env({"LOCAL_RANK": "2"})

    def set_device(index: int) -> None:
        raise AssertionError("torch would only say 'invalid device ordinal'")

    fake_cuda = SimpleNamespace(
        name="cuda", communication_backend="nccl", device_count=lambda: 2, set_device=set_device
    )
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(PROCESS, "timeout", PROCESS.timeout)  # init_distributed records its timeout
    monkeypatch.setattr(distributed, "get_accelerator", lambda: fake_cuda)
    with pytest.raises(LaunchEnvError, match=r"^LOCAL_RANK=2 is not below this node's 2 visible CUDA device\(s\)"):
        distributed.init_distributed()


@pytest.mark.parametrize("value", ["abc", "-1", "", "²", "9" * 5000])
def test_log_prefix_survives_a_malformed_rank(monkeypatch, value) -> None:
    monkeypatch.setattr("slipstream.utils.logging._rank", None)
    monkeypatch.setenv("RANK", value)
    assert current_rank() == 0
    monkeypatch.setenv("RANK", " 3 ")
    assert current_rank() == 3
