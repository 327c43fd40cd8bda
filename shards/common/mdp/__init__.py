"""MDP/0.2 (Majordomo) libraries: an asyncio worker (``worker.MdpWorker``) and clients
(``client.MdpClient``, asyncio; ``client.SyncMdpClient``, blocking). The wire codec is
``clonemap.shards.common.mdp.codec``; the broker is ``clonemap.shards.common.mdp.broker``.

The handler contract, shared by the worker library and the services a broker hosts
itself (``clonemap.shards.common.mdp.broker.Broker.register``)::

    async def stats(request: Request) -> Body:
        for figure in figures():
            await request.partial(b"figure", figure)   # zero or more PARTIALs
        return [b"done"]                                # the FINAL body

A handler may also be a plain function. Its return value is the FINAL body: ``None`` (one
empty frame), ``bytes``, ``str`` (UTF-8), or a sequence of ``bytes``. If it raises, the
library logs the traceback and answers FINAL ``[b"500", b"<Type>: <message>"]`` (the MMI
status-code style), so the request is not left hanging and the worker stays usable.
"""
from __future__ import annotations

import inspect
from typing import Awaitable, Callable, Sequence, Union

Body = Union[None, bytes, str, Sequence[bytes]]
SendBody = Callable[[list[bytes]], Awaitable[None]]


class Request:
    """One request handed to a handler: ``service``, ``body`` (frames), ``client`` (the
    client's address as the broker sees it), ``user_id`` (who the client is, as the ZAP
    handler named its connection; None without CURVE, or through a worker), and
    ``partial()`` to stream a PARTIAL."""

    __slots__ = ("service", "body", "client", "user_id", "_send_partial", "partials")

    def __init__(self, service: bytes, body: list[bytes], client: bytes,
                 send_partial: SendBody, user_id: str | None = None):
        self.service = service
        self.body = body
        self.client = client
        self.user_id = user_id
        self._send_partial = send_partial
        self.partials = 0

    async def partial(self, *body: bytes) -> None:
        """Send one PARTIAL reply now (an empty call sends one empty frame)."""
        self.partials += 1
        await self._send_partial(as_body(list(body)))

    def __repr__(self) -> str:
        return f"<Request {self.service!r} {len(self.body)} frame(s)>"


Handler = Callable[[Request], Union[Body, Awaitable[Body]]]


def as_body(result: Body) -> list[bytes]:
    """Normalise a handler's result to body frames (at least one, per the spec)."""
    if result is None:
        return [b""]
    if isinstance(result, bytes):
        return [result]
    if isinstance(result, str):
        return [result.encode("utf-8")]
    if isinstance(result, (bytearray, memoryview)):
        return [bytes(result)]
    frames = [f.encode("utf-8") if isinstance(f, str) else bytes(f) for f in result]
    return frames or [b""]


def error_body(exc: BaseException) -> list[bytes]:
    return [b"500", f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")]


async def run_handler(handler: Handler, request: Request) -> list[bytes]:
    """Call ``handler`` (plain or async) and return its FINAL body. Exceptions propagate."""
    result = handler(request)
    if inspect.isawaitable(result):
        result = await result
    return as_body(result)
