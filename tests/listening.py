"""What a run listens on: the TCP sockets in LISTEN held by a tree of processes, read from Linux's
/proc (the tests that use it skip elsewhere)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READABLE = Path("/proc/net/tcp").exists()


def process_tree(root: int) -> set[int]:
    """`root` and every live process below it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in tree}
        tree |= frontier
    return tree


def listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that one of `pids` holds, IPv4 and IPv6."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = fd.readlink().as_posix() if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # ended meanwhile
            continue
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((_address(address, family), int(port, 16)))
    return found


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)  # 32-bit words in the machine's (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


@contextmanager
def watched(root: int, every_s: float = 0.05) -> Iterator[set[tuple[str, int]]]:
    """Inside the block, every listening socket of the processes below `root` (not its own) is added
    to the set yielded."""
    seen: set[tuple[str, int]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(listening(process_tree(root) - {root}))
            time.sleep(every_s)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()
