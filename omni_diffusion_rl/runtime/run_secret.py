"""The shared secret of a run on several machines: every process proves it holds it before anything
else is exchanged, so a peer that reached machine 0's port without it is refused by every process.

The secret is the text of ODRL_RUN_SECRET, or of the file ODRL_RUN_SECRET_FILE names, the same on
every machine, at least MIN_SECRET_CHARS characters. The proof: each process draws a fresh random
nonce, all nonces are gathered (fixed-size tensors), and each process sends HMAC-SHA256(secret,
every nonce and its own rank), which every other process checks. The secret itself never travels,
and nothing seen in an earlier run can be replayed. A run whose machine 0 is at a loopback address
(its machines are processes of one host) may go without a secret; any other run needs one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import ConfigError

SECRET_VARIABLE = "ODRL_RUN_SECRET"
SECRET_FILE_VARIABLE = "ODRL_RUN_SECRET_FILE"
MIN_SECRET_CHARS = 16
MAX_SECRET_BYTES = 4096
NONCE_BYTES = 16
SECRET_HELP = (
    f"set {SECRET_VARIABLE} to the same secret on every machine, e.g. `export {SECRET_VARIABLE}="
    "$(python -c 'import secrets; print(secrets.token_urlsafe(32))')` on one and the same value on the "
    f"others (or {SECRET_FILE_VARIABLE} to a file holding it)"
)


class RunSecretError(ConfigError):
    """A run on several machines whose processes do not all prove the same shared secret."""


def run_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """This machine's secret (ODRL_RUN_SECRET, else the file ODRL_RUN_SECRET_FILE names), or None;
    a RunSecretError for one too short, too long or unreadable."""
    env = os.environ if env is None else env
    text, source = env.get(SECRET_VARIABLE), SECRET_VARIABLE
    if not text and env.get(SECRET_FILE_VARIABLE):
        path, source = (
            Path(env[SECRET_FILE_VARIABLE]),
            f"{SECRET_FILE_VARIABLE} ({env[SECRET_FILE_VARIABLE]})",
        )
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_SECRET_BYTES + 1)
            text = data.decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise RunSecretError(f"{source} cannot be read as text: {e}") from None
    if not text:
        return None
    secret = text.encode("utf-8")
    if len(text) < MIN_SECRET_CHARS or len(secret) > MAX_SECRET_BYTES:
        raise RunSecretError(
            f"the secret in {source} has {len(text)} characters: use {MIN_SECRET_CHARS} to "
            f"{MAX_SECRET_BYTES}, e.g. {SECRET_HELP.split('e.g. ', 1)[1]}"
        )
    return secret


def is_loopback(address: str) -> bool:
    """Whether `address` names this host only (127.0.0.0/8, ::1 or localhost)."""
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def secret_needed_problem(master_addr: str, machines: int, secret: bytes | None) -> str | None:
    """Why a launch must not start without a secret (several machines, machine 0 not at a loopback
    address), or None."""
    if machines <= 1 or secret is not None or is_loopback(master_addr):
        return None
    return (
        f"a run on {machines} machines with machine 0 at --master-addr {master_addr} needs a shared secret, "
        f"or anyone who can reach its port could join it: {SECRET_HELP}"
    )


def _proof(secret: bytes, nonces: bytes, rank: int) -> bytes:
    return hmac.new(
        secret, b"odrl-run-secret/" + nonces + rank.to_bytes(8, "little"), hashlib.sha256
    ).digest()


def prove_secret(
    secret: bytes | None, master_addr: str, machines: int, group: Any = None, device: Any = None
) -> None:
    """On every process of the group, right after it is up: each proves it holds `secret`, each
    checks every other's proof; a RunSecretError (the same on every process) when one does not, when
    some hold a secret and others none, or when none does and machine 0 is not at a loopback address.
    `device`: this process's (its GPU under nccl, which gathers nothing on the CPU)."""
    import torch
    import torch.distributed as dist

    from .distributed import collective_device

    on = collective_device(device, group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def gathered(data: bytes) -> list[bytes]:
        """Every process's `data` (the same length on each), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(on)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        return [part.cpu().numpy().tobytes() for part in parts]

    transcript = b"".join(gathered(os.urandom(NONCE_BYTES)))
    proofs = gathered(bytes([secret is not None]) + _proof(secret or b"", transcript, rank))
    held = [bool(p[0]) for p in proofs]
    if not any(held):
        problem = secret_needed_problem(master_addr, machines, None)
        if problem:
            raise RunSecretError(problem)
        return
    if not all(held):
        without = ", ".join(str(r) for r, has in enumerate(held) if not has)
        raise RunSecretError(
            f"process(es) {without} of the run hold no secret while others do: {SECRET_HELP}"
        )
    assert secret is not None  # this process's own flag is in `held`
    wrong = [
        str(r)
        for r, p in enumerate(proofs)
        if r != rank and not hmac.compare_digest(p[1:], _proof(secret, transcript, r))
    ]
    if wrong:
        raise RunSecretError(
            f"process(es) {', '.join(wrong)} did not prove this machine's secret: it is not the same on "
            f"every machine, or a process that is not part of the run joined it; {SECRET_HELP}"
        )
