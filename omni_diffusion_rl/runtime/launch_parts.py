"""What odrl's two launchers share (forking_launcher.py on one machine, machine_zero.py on machine 0
of several): the entry point their processes run, accelerate's variables, and a run's store on a
socket bound to one address (torch's own store would listen on every interface)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta

ENTRY_MODULE = "omni_diffusion_rl.cli"  # each process runs `python -m ENTRY_MODULE ARGS`
REFUSED_CODE = 2  # odrl's exit code after its one-sentence refusal
# What accelerate launch sets for the processes of a run without mixed precision or dynamo.
ACCELERATE_VARIABLES = {
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
}


def after_dashes(args: Sequence[str]) -> list[str]:
    """A launcher's trailing command line, without the `--` that separates it from its options."""
    return list(args[1:] if args[:1] == ["--"] else args)


def listen(address: str, port: int) -> socket.socket:
    """A listening socket bound to `address`:`port` only (port 0: a free one); OSError if taken."""
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address, port), family=family)


def store_on(listener: socket.socket, address: str, port: int, timeout_s: float, multi_tenant: bool = False):  # noqa: ANN201 - torch's TCPStore
    """The run's store on `listener`, which it owns from here (and closes). Multi-tenant: a store
    torch creates later in this process on the same port is served by this one."""
    import torch.distributed as dist

    return dist.TCPStore(
        address,
        port,
        None,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        master_listen_fd=listener.detach(),
    )
