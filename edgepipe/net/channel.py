"""Channels: the one interface coordinator and worker code use to talk.

A channel sends and receives whole frames (bytes). ``memory_pair`` gives two connected
in-process ends for tests; ``websocket_channel`` adapts a ``websockets`` connection and
``starlette_channel`` a Starlette WebSocket. Shaping (emulated links) wraps any channel.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class ChannelClosed(ConnectionError):
    pass


class Channel(Protocol):
    peer: str

    async def send(self, frame: bytes) -> None: ...

    async def recv(self) -> bytes: ...

    async def close(self, reason: str = "") -> None: ...


class MemoryChannel:
    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, peer: str):
        self._inbox, self._outbox, self.peer = inbox, outbox, peer
        self.closed = False

    async def send(self, frame: bytes) -> None:
        if self.closed:
            raise ChannelClosed(f"channel to {self.peer} is closed")
        await self._outbox.put(frame)

    async def recv(self) -> bytes:
        frame = await self._inbox.get()
        if frame is None:
            self.closed = True
            raise ChannelClosed(f"{self.peer} closed the channel")
        return frame

    async def close(self, reason: str = "") -> None:
        if not self.closed:
            self.closed = True
            await self._outbox.put(None)


def memory_pair(a: str = "a", b: str = "b") -> tuple[MemoryChannel, MemoryChannel]:
    q1, q2 = asyncio.Queue(), asyncio.Queue()
    return MemoryChannel(q1, q2, b), MemoryChannel(q2, q1, a)


class WebSocketChannel:
    """A ``websockets`` client or server connection as a channel."""

    def __init__(self, ws, peer: str = ""):
        self.ws, self.peer = ws, peer or str(getattr(ws, "remote_address", ""))

    async def send(self, frame: bytes) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            await self.ws.send(frame)
        except ConnectionClosed as exc:
            raise ChannelClosed(f"{self.peer}: {exc}") from None

    async def recv(self) -> bytes:
        from websockets.exceptions import ConnectionClosed

        try:
            return await self.ws.recv()
        except ConnectionClosed as exc:
            raise ChannelClosed(f"{self.peer}: {exc}") from None

    async def close(self, reason: str = "") -> None:
        await self.ws.close(1000 if not reason else 1008, reason[:120])


class StarletteChannel:
    """A Starlette (ASGI) WebSocket as a channel; text frames are passed up as ``str``."""

    def __init__(self, ws, peer: str = ""):
        self.ws = ws
        self.peer = peer or (f"{ws.client.host}:{ws.client.port}" if ws.client else "?")
        self.closed = False

    async def send(self, frame: bytes) -> None:
        if self.closed:
            raise ChannelClosed(f"channel to {self.peer} is closed")
        try:
            await self.ws.send_bytes(frame)
        except Exception as exc:  # starlette raises assorted errors on a dead socket
            self.closed = True
            raise ChannelClosed(f"{self.peer}: {exc}") from None

    async def recv(self):
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            self.closed = True
            raise ChannelClosed(f"{self.peer} disconnected")
        return message.get("bytes") if message.get("bytes") is not None else message.get("text", "")

    async def close(self, reason: str = "") -> None:
        if not self.closed:
            self.closed = True
            try:
                await self.ws.close(code=1008 if reason else 1000, reason=reason[:120])
            except Exception:
                pass


class ShapedChannel:
    """Delays and paces outgoing frames as an emulated link would (user-space shaping)."""

    def __init__(self, inner: Channel, link):
        self.inner, self.link, self.peer = inner, link, inner.peer  # link: emulate.shaper.ShapedLink

    async def send(self, frame: bytes) -> None:
        wait = self.link.send_delay(len(frame), time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)
        await self.inner.send(frame)

    async def recv(self) -> bytes:
        return await self.inner.recv()

    async def close(self, reason: str = "") -> None:
        await self.inner.close(reason)
