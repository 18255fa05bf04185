"""The processes of a run spread over several machines: do they belong to one run?

Each machine starts its own launcher (`odrl train --nnodes M --node-rank R ...`, or `accelerate launch
--num_machines M --machine_rank R ...`), so each can be given another process count or config. Two
checks in every process of such a run:

- before the process group, `wait_for_every_process`: every process reaches the start within the
  join timeout (one that died before would leave the others in init_process_group for half an hour);
- right after it, `check_machines_agree`: every process proves the run's shared secret
  (`run_secret.py`), then gathers each one's layout (its machine, the processes there, the processes
  its launcher declared in all, a hash of its config) and all refuse a run whose machines disagree,
  saying what to make equal.

Files in ODRL_LAUNCH_DIR (set by `odrl train`'s launcher) tell that launcher that its processes
started (the machines joined), or that one stopped the run with a sentence (`odrl: ...`, exit 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..config import ConfigError
from .run_secret import prove_secret, run_secret

LAUNCH_DIR_VARIABLE = "ODRL_LAUNCH_DIR"  # where launched processes leave their markers
DECLARED_WORLD_VARIABLE = "ODRL_DECLARED_WORLD"  # the processes in all that `odrl train` launched for
STARTED, REFUSED = "started", "refused"  # marker names: the processes started; one stopped with a sentence
SHOWN_DIFFERENCES = 5  # config keys named per machine


class LaunchError(ConfigError):
    """The machines of a run cannot start it together; the first process of each machine says why."""


@dataclass(frozen=True)
class ProcessLayout:
    """What one process knows of the run it was started for."""

    rank: int
    machine: int
    host: str
    local_processes: int  # started on its machine
    declared_world: int  # in all, as its machine's launcher was told
    config_sha256: str


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def machine_count(env: Mapping[str, str] | None = None) -> int:
    """The machines (torch elastic's nodes) of this process's run; 1 outside a launcher."""
    return _int(_env(env), "GROUP_WORLD_SIZE", 1)


def config_digest(config: Mapping[str, Any]) -> str:
    """A hash of a config's values (its to_dict())."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def describe_process(config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> ProcessLayout:
    """This process's layout, from its launcher's environment. accelerate launch declares no total:
    it starts its --num_processes // --num_machines on each machine, so that times the machines."""
    env = _env(env)
    local = _int(env, "LOCAL_WORLD_SIZE", 1)
    return ProcessLayout(
        rank=_int(env, "RANK", 0),
        machine=_int(env, "GROUP_RANK", 0),
        host=socket.gethostname(),
        local_processes=local,
        declared_world=_int(env, DECLARED_WORLD_VARIABLE, local * machine_count(env)),
        config_sha256=config_digest(config),
    )


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def layout_problem(layouts: Sequence[ProcessLayout], world: int) -> str | None:
    """What the machines disagree on about the process layout (None: they agree with the `world`
    processes that joined)."""
    by_machine: dict[int, list[ProcessLayout]] = {}
    for layout in sorted(layouts, key=lambda item: item.rank):
        by_machine.setdefault(layout.machine, []).append(layout)
    counts = {len(members) for members in by_machine.values()}
    if {layout.declared_world for layout in layouts} == {world} and len(counts) == 1:
        return None
    machines = ", ".join(
        f"machine {machine} ({members[0].host}) runs {_processes(len(members))} and its launcher declared "
        f"{members[0].declared_world} in all"
        for machine, members in sorted(by_machine.items())
    )
    return (
        f"the machines do not agree on the run's layout: {machines}; {_processes(world)} joined. Start every "
        "machine with the same --nproc (processes per machine) and --nnodes; with accelerate launch, the "
        "same --num_processes (in all) and --num_machines"
    )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'steps': 2}} -> {'train.steps': 2}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value and prefix == "":
            flat.update(flatten(value, f"{key}."))
        else:
            flat[prefix + str(key)] = value
    return flat


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def config_problem(configs: Sequence[tuple[int, Mapping[str, Any]]]) -> str | None:
    """Which machines were given another config than machine 0, key by key (None: all the same).
    `configs`: (machine, flattened config) of every process."""
    first: dict[int, Mapping[str, Any]] = {}
    for machine, config in configs:
        first.setdefault(machine, config)
    reference = first[min(first)]  # machine 0's
    found = []
    for machine, config in sorted(first.items()):
        keys = sorted(k for k in set(config) | set(reference) if config.get(k) != reference.get(k))
        if not keys:
            continue
        named = "; ".join(
            f"{k} is {_shown(config.get(k))} there and {_shown(reference.get(k))} on machine 0"
            for k in keys[:SHOWN_DIFFERENCES]
        )
        more = f" (and {len(keys) - SHOWN_DIFFERENCES} more)" if len(keys) > SHOWN_DIFFERENCES else ""
        found.append(f"machine {machine} was given another config than machine 0: {named}{more}")
    if not found:
        return None
    return (
        ". ".join(found) + ". Give every machine the same config file and overrides (only --node-rank "
        "differs between the machines' commands)"
    )


def mark(event: str, env: Mapping[str, str] | None = None) -> None:
    """Tell `odrl train`'s launcher (if it started this process) that `event` happened here."""
    env = _env(env)
    directory = env.get(LAUNCH_DIR_VARIABLE)
    if not directory:
        return
    try:
        (Path(directory) / f"{event}.{_int(env, 'RANK', 0)}").touch()
    except OSError:  # the launcher is gone (its folder with it): nobody to tell
        pass


def marked(directory: str | Path, event: str) -> bool:
    """Whether a process of the launcher that owns `directory` marked `event`."""
    return any(Path(directory).glob(f"{event}.*"))


def wait_for_every_process(timeout_s: float, env: Mapping[str, str] | None = None) -> None:
    """Before the process group: wait until every process of a run on several machines has started,
    at most `timeout_s` (LaunchError naming the ones that did not). They meet in the store of torch
    elastic's agent on machine 0; without several machines or that store there is nothing to do."""
    env = _env(env)
    if machine_count(env) <= 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from datetime import timedelta

    import torch.distributed as dist

    world, rank = _int(env, "WORLD_SIZE", 1), _int(env, "RANK", 0)
    address = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    prefix = (
        f"odrl_join/{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    keys = [f"{prefix}/{r}" for r in range(world)]
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(str(env.get("MASTER_ADDR")), int(env.get("MASTER_PORT", "0")), timeout=timeout)
    except dist.DistError as e:
        raise LaunchError(
            f"the run's store on machine 0 ({address}) did not answer within {timeout_s:g} s "
            f"(--join-timeout): its launcher stopped; its output says why ({e})"
        ) from None
    try:
        store.set(keys[rank], str(_int(env, "GROUP_RANK", 0)))
        store.wait(keys, timeout)
    except dist.DistError:
        missing = ", ".join(_missing(store, keys)) or "some"
        raise LaunchError(
            f"process(es) {missing} of {world} did not start within {timeout_s:g} s (--join-timeout) "
            "although every machine joined: one failed or was stopped before the run began (its machine's "
            "output says why); start the run again on every machine"
        ) from None


def _missing(store: Any, keys: Sequence[str]) -> list[str]:
    """The ranks whose key is not in `store` (none when the store itself is gone)."""
    import torch.distributed as dist

    try:
        return [str(rank) for rank, key in enumerate(keys) if not store.check([key])]
    except dist.DistError:
        return []


def _gather(value: Any, device: Any = None) -> list[Any]:
    """Every process's JSON value, as JSON (never pickle: a peer machine is not trusted to run code here);
    `device`: this process's (its GPU under nccl, which gathers nothing on the CPU)."""
    from .distributed import all_gather_json

    return all_gather_json(value, device=device)


def _layouts(values: list[Any]) -> list[ProcessLayout]:
    """The gathered layouts, each checked to be one: a peer's fields of the right types, or a LaunchError."""
    declared = {f.name: f.type for f in fields(ProcessLayout)}
    layouts = []
    for rank, value in enumerate(values):
        ok = isinstance(value, dict) and value.keys() == declared.keys()
        ok = ok and all(
            isinstance(value[k], str) if t in ("str", str) else type(value[k]) is int
            for k, t in declared.items()
        )
        if not ok:
            raise LaunchError(
                f"process {rank} described its process layout as {str(value)[:200]!r}, not as every "
                "process does; every machine must run the same omni-diffusion-rl"
            )
        layouts.append(ProcessLayout(**value))
    return layouts


def check_machines_agree(
    config: Mapping[str, Any], env: Mapping[str, str] | None = None, device: Any = None
) -> None:
    """Right after the process group is up, on every process of a run on several machines: refuse
    (LaunchError, the same on every process) a run whose machines declared other process counts or
    were given other configs."""
    import torch.distributed as dist

    env = _env(env)
    machines = machine_count(env)
    if machines <= 1 or not (dist.is_available() and dist.is_initialized()):
        return
    address = str(env.get("MASTER_ADDR", ""))
    prove_secret(run_secret(env), address, machines, device=device)  # before anything a peer sends is read
    layouts = _layouts(_gather(asdict(describe_process(config, env)), device))
    problems = [layout_problem(layouts, dist.get_world_size())]
    if len({layout.config_sha256 for layout in layouts}) > 1:  # the same on every process
        flat = _gather(flatten(config), device)
        problems.append(
            config_problem([(layout.machine, c) for layout, c in zip(layouts, flat, strict=True)])
        )
    found = [p for p in problems if p]
    if found:
        raise LaunchError(". Also, ".join(found))
