"""A reward or teacher server's settings, and the rules its address and token keep: 127.0.0.1 by
default, a token of enough entropy whenever it listens elsewhere."""

from __future__ import annotations

import ipaddress
import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)


API_VERSION = 1


MAX_WAIT_MS = 60_000.0  # a batch waits at most a minute to fill (--max-wait-ms)


TOKEN_HELP = (
    "set one in the environment, e.g. "
    "`export ODRL_REWARD_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`"
)


@dataclass
class ServeSettings:
    """What `odrl serve-reward` serves with; `check()` refuses settings that cannot work or are unsafe."""

    host: str = "127.0.0.1"
    port: int = 8400
    max_batch: int = 32  # samples per model call
    max_wait_ms: float = 5.0  # how long the oldest request may wait for others to join its batch
    max_request_mb: float = 256.0
    max_in_flight: int = 256  # requests read (body in) and not yet answered; more get 503 (clients retry)
    max_uploads_mb: float = (
        4096.0  # bodies arriving at once, by declared size (chunked: max_request_mb); more: 503
    )
    token: str | None = None
    read_timeout_s: float = 30.0  # to receive a request's body once its headers are in; slower: 408, closed
    keepalive_timeout_s: float = 15.0  # a connection without a complete request (headers) for this is closed
    shutdown_timeout_s: float = 2.0  # on Ctrl-C, requests being scored get this long to be answered
    service_ms: float = 0.0  # teachers: a fixed time added per model call (a remote accelerator's stand-in)

    def check(self) -> None:
        if self.max_batch < 1 or self.max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be >= 1")
        if not (math.isfinite(self.max_wait_ms) and 0 <= self.max_wait_ms <= MAX_WAIT_MS):
            # nan: every lone request waited out the client's timeout; inf: it was never answered
            raise ValueError(
                f"max_wait_ms (--max-wait-ms) must be a number of milliseconds from 0 to {MAX_WAIT_MS:g}; "
                f"got {self.max_wait_ms}"
            )
        if not (math.isfinite(self.max_request_mb) and self.max_request_mb > 0):
            raise ValueError(
                f"max_request_mb (--max-request-mb) must be a number of MB above 0: {self.max_request_mb}"
            )
        if not (math.isfinite(self.max_uploads_mb) and self.max_uploads_mb >= self.max_request_mb):
            raise ValueError(
                f"max_uploads_mb ({self.max_uploads_mb}) must be a number of MB at least max_request_mb "
                f"({self.max_request_mb}), or no request of the largest size could ever be received"
            )
        if not (math.isfinite(self.service_ms) and self.service_ms >= 0):
            raise ValueError(f"service_ms must be a number of milliseconds >= 0; got {self.service_ms}")
        for name in ("read_timeout_s", "keepalive_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds; got {value}")
        if self.token is not None:
            _check_token(self.token)
        if not self.token and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without a token: anyone who reaches it could use it. "
                "Set one in the environment (ODRL_REWARD_TOKEN, or --token-env NAME), or bind 127.0.0.1"
            )


def _check_token(token: str) -> None:
    """Refuse a token a client could not send as given: empty, with whitespace, or not printable ASCII."""
    if not token.strip():
        raise ValueError(f"the reward server's token is empty or only whitespace; {TOKEN_HELP}")
    if any(c.isspace() for c in token):
        raise ValueError(
            "the reward server's token contains whitespace (leading, trailing or inside), which "
            f"'Authorization: Bearer <token>' cannot carry as given; {TOKEN_HELP}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"the reward server's token has characters outside printable ASCII, which HTTP headers cannot "
            f"carry reliably; {TOKEN_HELP}"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
