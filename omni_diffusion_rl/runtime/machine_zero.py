"""Machine 0 of a run on several machines: torch's elastic agent, with its store bound to --master-addr.

The machines of a run meet in torch elastic's static rendezvous (what `accelerate launch
--num_machines M` runs), so that any machine may be started with `odrl train --nnodes M` or with
`accelerate launch`. Its store, on machine 0, is a TCPStore that torch creates with no address to
bind: it listens on --master-port on every interface of the machine.

This launcher binds that port to --master-addr itself and starts the store on that socket, as a
multi-tenant store, before it runs the elastic agent in this same process (what accelerate launch
runs, with the environment accelerate gives its processes). The agent's own store is multi-tenant
on the same port, so it is served by the one already there: nothing listens on the port beyond
--master-addr. Should a torch release stop sharing it, the agent fails to listen on a taken port
and the run stops at once; it never listens more widely.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from .launch_parts import ACCELERATE_VARIABLES, ENTRY_MODULE, REFUSED_CODE, after_dashes, listen, store_on

BIND_FAILED = b"odrl: machine 0 cannot listen on"  # its line when --master-port is taken


def machine_zero_command(
    nproc: int, machines: int, address: str, port: int, join_timeout_s: float, args: Sequence[str]
) -> list[str]:
    """The command that starts machine 0's `nproc` processes of `machines`, each `python -m
    omni_diffusion_rl.cli ARGS`."""
    command = [sys.executable, "-m", __name__, "--nproc", str(nproc), "--nnodes", str(machines)]
    command += ["--master-addr", address, "--master-port", str(port)]
    command += ["--join-timeout", str(math.ceil(join_timeout_s))]
    return [*command, "--", *args]


def torchrun_arguments(
    nproc: int, machines: int, address: str, port: int, join_timeout_s: int, args: Sequence[str]
) -> list[str]:
    """torch.distributed.run's arguments for machine 0, as accelerate launch gives them."""
    return [
        "--nnodes",
        str(machines),
        "--node-rank",
        "0",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "static",
        "--rdzv-endpoint",
        f"{address}:{port}",
        "--rdzv-conf",
        f"timeout={join_timeout_s}",
        "--max-restarts",
        "0",
        "--module",
        ENTRY_MODULE,
        *args,
    ]


def bind_store(address: str, port: int, timeout_s: float):  # noqa: ANN201 - torch's TCPStore
    """The run's store on `address`:`port` only (OSError when the port is taken there); the elastic
    agent's store, multi-tenant too, is served by this one."""
    return store_on(listen(address, port), address, port, timeout_s, multi_tenant=True)


def run(nproc: int, machines: int, address: str, port: int, join_timeout_s: int, args: Sequence[str]) -> int:
    """Machine 0's part of the run; the elastic agent's exit code (as accelerate launch's)."""
    try:
        store = bind_store(address, port, join_timeout_s)
    except OSError as e:  # launch.py turns this line into its sentence
        print(f"{BIND_FAILED.decode()} {address}:{port}: {e.strerror}", file=sys.stderr, flush=True)
        return REFUSED_CODE
    from accelerate.utils import check_cuda_p2p_ib_support

    if not check_cuda_p2p_ib_support():  # as accelerate launch does on cards without P2P
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    os.environ.update(ACCELERATE_VARIABLES)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # accelerate launch's default too
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as run_agent

    parsed = get_args_parser().parse_args(
        torchrun_arguments(nproc, machines, address, port, join_timeout_s, args)
    )
    try:
        run_agent(parsed)
    except KeyboardInterrupt:
        return 130
    except SignalException as stop:  # the agent stopped its processes first
        return 128 + int(stop.sigval)
    except Exception as failure:  # noqa: BLE001 - the agent's report of its processes' exits
        print(failure, file=sys.stderr, flush=True)
        return 1
    finally:
        del store
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--join-timeout", type=int, required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    return run(ns.nproc, ns.nnodes, ns.master_addr, ns.master_port, ns.join_timeout, after_dashes(ns.args))


if __name__ == "__main__":
    sys.exit(main())
