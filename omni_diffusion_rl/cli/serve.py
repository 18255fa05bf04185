"""`odrl serve-reward` and `odrl serve-teacher`: rewards and teachers as servers."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..config import ConfigError
from .arguments import _json_options, _port, _positive_int

if TYPE_CHECKING:
    from ..serving.server import ServeSettings

    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _serve_settings(args: argparse.Namespace, **extra: float) -> ServeSettings:
    """The server settings the shared serve-reward / serve-teacher options give (checked)."""
    from ..serving.server import ServeSettings

    token = os.environ.get(args.token_env) or None
    settings = ServeSettings(
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_request_mb=args.max_request_mb,
        max_in_flight=args.max_in_flight,
        max_uploads_mb=args.max_uploads_mb,
        token=token,
        read_timeout_s=args.read_timeout_s,
        keepalive_timeout_s=args.keepalive_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        **extra,  # type: ignore[arg-type]
    )
    try:
        settings.check()
    except ValueError as e:
        raise ConfigError(str(e).replace("ODRL_REWARD_TOKEN", args.token_env)) from e
    return settings


def cmd_serve_teacher(args: argparse.Namespace) -> int:
    from ..config import import_plugins
    from ..registry import teachers

    import_plugins(args.plugin or [])
    options = _json_options(args.options, '{"pretrained": "/models/teacher"}')
    if not isinstance(options, dict):
        raise ConfigError("--options must be a JSON object of the teacher's keyword arguments")
    settings = _serve_settings(args, service_ms=args.service_ms)
    _check_can_listen(settings)  # before the teacher loads
    _thread_budget(args)
    for key, value in (("checkpoint", args.checkpoint), ("device", args.device)):
        if value:
            options.setdefault(key, value)
    try:
        teacher = teachers.create(args.name, **options)
    except TypeError as e:
        raise ConfigError(f"teacher '{args.name}' could not be created with {sorted(options)} ({e})") from e
    return _serve({}, settings, teachers={args.name: teacher})


def cmd_serve_reward(args: argparse.Namespace) -> int:
    from ..config import import_plugins
    from ..registry import rewards

    import_plugins(args.plugin or [])
    options = _json_options(args.options, '{"clap": {"checkpoint": "/m"}}')
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ConfigError("--options must map reward names to keyword-argument objects")
    unknown = sorted(set(options) - set(args.names))
    if unknown:
        raise ConfigError(f"--options names rewards that are not served: {unknown}")
    settings = _serve_settings(args)
    _check_can_listen(settings)  # before the rewards load
    _thread_budget(args)
    served = {}
    for name in args.names:
        kwargs = dict(options.get(name, {}))
        if args.checkpoint:
            kwargs.setdefault("checkpoint", args.checkpoint)
        if args.device:
            kwargs.setdefault("device", args.device)
        try:
            served[name] = rewards.create(name, **kwargs)
        except TypeError as e:
            raise ConfigError(
                f"reward '{name}' could not be created with {sorted(kwargs)} ({e}); give each reward its "
                "own keyword arguments with --options"
            ) from e
    return _serve(served, settings)


def _thread_budget(args: argparse.Namespace) -> int:
    """Set the server's thread budget before its models load: --threads, else OMP_NUM_THREADS when
    set, else its share of the host's cores; the ready line reports it."""
    from ..runtime.threads import apply_thread_budget, thread_share

    given = os.environ.get("OMP_NUM_THREADS", "")
    default = int(given) if given.isdigit() and int(given) > 0 else thread_share(args.replicas_on_host)
    return apply_thread_budget(args.threads or default)


def _serve(rewards: dict, settings: ServeSettings, teachers: dict | None = None) -> int:
    """Run the server; a port taken since the check at start is a sentence too."""
    from ..serving.server import main_serve

    with _listen_errors(settings):
        return main_serve(rewards, settings, teachers=teachers)


def _check_can_listen(settings: ServeSettings) -> None:
    """Refuse, before any model loads, a --host/--port this process cannot listen on."""
    if settings.port == 0:
        return
    with _listen_errors(settings):
        addresses = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
                probe.bind(address)


@contextmanager
def _listen_errors(settings: ServeSettings) -> Iterator[None]:
    """The OS errors of listening on --host/--port as ConfigError sentences; any other unchanged."""
    try:
        yield
    except OSError as e:
        refusal = _listen_refusal(e, settings.host, settings.port)
        if refusal is None:
            raise
        raise refusal from e


def _listen_refusal(e: OSError, host: str, port: int) -> ConfigError | None:
    """The sentence for an error listening on host:port, or None when it is none of those."""
    if isinstance(e, socket.gaierror):
        return ConfigError(f"--host {host} is not a name or address of this machine ({e.strerror})")
    reasons = {
        errno.EADDRINUSE: f"port {port} on {host} is in use (another server?): stop it, or pass another "
        "--port (0 picks a free one)",
        errno.EADDRNOTAVAIL: f"--host {host} is not an address of this machine: give one of its "
        "addresses, 127.0.0.1 (default) or 0.0.0.0 (every address, with a token)",
        errno.EACCES: f"port {port} on {host} needs privileges here: pass --port 1024 or above (0 picks a "
        "free one)",
    }
    reason = reasons.get(e.errno)
    return ConfigError(f"cannot listen: {reason}") if reason else None


def add_server_arguments(parser: argparse.ArgumentParser, token_env: str, port: int) -> None:
    """The options every server takes: address, batching, limits, timeouts and its token."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=port, help="0 picks a free port (see the ready line)")
    parser.add_argument(
        "--max-batch",
        type=_positive_int,
        default=32,
        help="samples per model call and per request",
    )
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="wait for a batch to fill, at most")
    parser.add_argument("--max-request-mb", type=float, default=256.0, help="larger requests get 413")
    parser.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=256,
        help="more concurrent requests get 503",
    )
    parser.add_argument(
        "--max-uploads-mb",
        type=float,
        default=4096.0,
        help="request bodies arriving at once, by declared size (chunked: --max-request-mb); more get 503",
    )
    parser.add_argument(
        "--read-timeout-s", type=float, default=30.0, help="time to receive a request's body; slower get 408"
    )
    parser.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=15.0,
        help="close connections idle (or without complete request headers) this long",
    )
    parser.add_argument(
        "--shutdown-timeout-s", type=float, default=2.0, help="on Ctrl-C, time for requests being answered"
    )
    parser.add_argument("--token-env", default=token_env, help="environment variable with the token")
    parser.add_argument(
        "--threads",
        type=_positive_int,
        help="threads the model computes on (default: OMP_NUM_THREADS when set, else the host's cores / "
        "--replicas-on-host)",
    )
    parser.add_argument(
        "--replicas-on-host",
        type=_positive_int,
        default=1,
        help="servers computing on this host at once, sharing its cores (sets the default --threads)",
    )


def _add_serve_reward(sub: Subcommands) -> None:
    """`odrl serve-reward`: registered rewards over HTTP."""
    serve = sub.add_parser(
        "serve-reward",
        help="serve registered rewards over HTTP (batched), for reward.url",
        description="Serve registered rewards over HTTP: POST /score/NAME (safetensors media), GET /info, "
        "GET /health. Prints a JSON 'ready' line with the URL once listening. Binding anything but "
        "loopback needs a bearer token in the environment (--token-env).",
    )
    serve.add_argument("names", nargs="+", metavar="NAME", help="registered reward names to serve")
    serve.add_argument("--checkpoint", help="checkpoint= for each served reward (e.g. a CLAP directory)")
    serve.add_argument("--device", help="device= for each served reward (e.g. cuda:0)")
    serve.add_argument("--options", help='JSON keyword arguments per reward: {"clap": {"max_seconds": 5}}')
    serve.add_argument(
        "--plugin", action="append", help="import this module or .py file first (it registers rewards)"
    )
    add_server_arguments(serve, "ODRL_REWARD_TOKEN", 8400)
    serve.set_defaults(func=cmd_serve_reward)


def _add_serve_teacher(sub: Subcommands) -> None:
    """`odrl serve-teacher`: a registered teacher over HTTP."""
    teach = sub.add_parser(
        "serve-teacher",
        help="serve a registered teacher over HTTP (batched), for teacher.urls",
        description="Serve a teacher over HTTP: POST /velocity/NAME (safetensors states, times and prompts; "
        "answers velocities), GET /info (its latent layout, convention and fingerprint), GET /health. "
        "Prints a JSON 'ready' line with the URL once listening. Binding anything but loopback needs a "
        "bearer token in the environment (--token-env).",
    )
    teach.add_argument("name", metavar="NAME", help="registered teacher (e.g. policy)")
    teach.add_argument("--checkpoint", help="checkpoint= of the teacher (a training checkpoint for 'policy')")
    teach.add_argument("--device", help="device= of the teacher (e.g. cuda:1)")
    teach.add_argument(
        "--options", help='JSON keyword arguments: {"pretrained": "builtin-teacher", "cfg_scale": 1}'
    )
    teach.add_argument(
        "--plugin", action="append", help="import this module or .py file first (it registers teachers)"
    )
    teach.add_argument(
        "--service-ms",
        type=float,
        default=0.0,
        help="benchmarks only: add this fixed time per model call, a stand-in for a remote accelerator",
    )
    add_server_arguments(teach, "ODRL_TEACHER_TOKEN", 8500)
    teach.set_defaults(func=cmd_serve_teacher)
