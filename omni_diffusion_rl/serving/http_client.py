"""What the reward and teacher clients share: the connections they keep open."""

from __future__ import annotations

import asyncio
import atexit
import weakref

import aiohttp

from ..reward import background_loop

# Idle connections are dropped before the server's keepalive_timeout_s (15 s by default) closes them,
# so a request never goes out on a connection the server is closing at that moment.
KEEPALIVE_S = 10.0
SESSIONS: weakref.WeakSet[aiohttp.ClientSession] = weakref.WeakSet()


@atexit.register
def _close_sessions() -> None:
    """Close connections left open at exit (a client not closed after an error)."""
    sessions = [s for s in SESSIONS if not s.closed]
    loop = background_loop()
    if sessions and loop.is_running():

        async def close_all() -> None:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=5)
