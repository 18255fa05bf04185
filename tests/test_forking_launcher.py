"""The forking launcher of `odrl train --nproc N` (runtime/forking_launcher.py): its processes see what
torch's elastic agent gives its own, a run listens on the loopback address only, and a process that
crashes is named and stops the others."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from omni_diffusion_rl.runtime.forking_launcher import agent_command, process_environment
from omni_diffusion_rl.runtime.subprocesses import run_process_tree

from . import listening
from .helpers import ENV, REPO, fast_overrides, tiny_model_dir

# What torch's elastic agent and `accelerate launch --multi_gpu` set in each process on one machine
# (printed by a process they started), less the agent's error file and its signal list.
ELASTIC_VARIABLES = {
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_MODE",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
    "ACCELERATE_MIXED_PRECISION",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "RANK",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "WORLD_SIZE",
}


def test_each_process_gets_the_elastic_agents_variables() -> None:
    env = process_environment({"HOME": "/home/u", "OMP_NUM_THREADS": "3"}, rank=1, nproc=2, port=4321)
    assert ELASTIC_VARIABLES <= set(env), ELASTIC_VARIABLES - set(env)
    ranks = (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"])
    assert ranks == ("1", "1", "2", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "4321")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # every process a client of the launcher's store
    assert env["OMP_NUM_THREADS"] == "3" and env["HOME"] == "/home/u"  # the user's choices stay
    assert process_environment({}, 0, 2, 1)["OMP_NUM_THREADS"] == "1"  # the agent's default otherwise
    if any(name == "lo" for _, name in socket.if_nameindex()):
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert process_environment({"GLOO_SOCKET_IFNAME": "eth9"}, 0, 2, 1)["GLOO_SOCKET_IFNAME"] == "eth9"
    with pytest.raises(ValueError, match="at least 1"):
        agent_command(0, ["train"])


@pytest.mark.slow
@pytest.mark.skipif(not listening.READABLE, reason="reads Linux's socket tables")
def test_a_run_listens_on_the_loopback_address_only(tmp_path: Path) -> None:
    """Every socket a 2-process run listens on (the store, gloo's pairs) is bound to 127.0.0.1: none
    is reachable from another machine (torch's own store listens on every interface)."""
    run = tmp_path / "run"
    args = ["train", *fast_overrides(tiny_model_dir(tmp_path / "model"), run, 3)]
    env = {**ENV, "ACCELERATE_USE_CPU": "true"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    with listening.watched(os.getpid()) as seen:
        done = run_process_tree(agent_command(2, args), timeout_s=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(seen) >= 2, f"the store and gloo's listeners were seen: {seen}"
    assert {address for address, _ in seen} == {"127.0.0.1"}, seen


@pytest.mark.slow
def test_a_crashed_process_is_named_and_the_others_are_stopped(tmp_path: Path) -> None:
    """Process 1 ends with exit code 17 in its first reward call, while process 0 goes on to wait for
    it in a collective: the launcher names the crash, stops process 0 and exits with 17 (the run ends
    by itself; the timeout is only a hang stop)."""
    run = tmp_path / "run"
    args = ["train", *fast_overrides(tiny_model_dir(tmp_path / "model"), run, 20)]
    args += ["reward.plugins=[tests.plugin_rewards]", "reward.weights={test_dies_on_rank: 1.0}"]
    env = {**ENV, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(REPO), "ODRL_TEST_DIE_RANK": "1"}
    done = run_process_tree(agent_command(2, args), timeout_s=300, env=env, cwd=REPO)
    assert done.returncode == 17, done.stderr[-3000:]
    assert "odrl: training process 1 of 2 ended with exit code 17; stopping the others" in done.stderr


@pytest.mark.parametrize("launcher", ["one machine", "machine 0 of several"])
def test_the_store_refuses_a_connect_to_another_loopback_address(launcher: str) -> None:
    """The store answers at 127.0.0.1 (the address given) and refuses 127.0.0.2, which a store bound
    to every interface (torch's own) would accept."""
    from omni_diffusion_rl.runtime import forking_launcher, launch_parts, machine_zero

    if launcher == "one machine":
        listener = forking_launcher._listen("127.0.0.1", 0)
        port = listener.getsockname()[1]
        store = launch_parts.store_on(listener, "127.0.0.1", port, 30)
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        store = machine_zero.bind_store("127.0.0.1", port, 30)
    try:
        store.set("key", "value")
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        del store
