"""A client that half-closes its connection before its body is whole still gets its
answer (issue 38, item 16).

HTTP/1.1 lets a client shut the writing half of its connection after the request and
read the answer (``shutdown(SHUT_WR)``: ``nc -N``, ``curl`` on some platforms, test
harnesses). aiohttp's server protocol closes the whole connection on that EOF, so a
request whose body ended before its ``Content-Length`` got no answer at all, only a log
line. :class:`HalfCloseHandler` keeps the writing half open when the EOF arrives while a
request's body is still expected: the body ends there, the handler's
:func:`flowlift.proxy.http.read_body` sees fewer bytes than announced and answers 400
``incomplete_body`` in the OpenAI error shape, and the connection closes after that
answer. An EOF between requests closes the connection as before.

:class:`ProxyRunner` is :class:`aiohttp.web.AppRunner` serving with that protocol
(``flowlift serve`` uses it, :mod:`flowlift.proxy.lifecycle`). The asyncio contract
relied on: a protocol whose ``eof_received`` returns True keeps the transport open for
writing (``asyncio.Protocol.eof_received``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


class HalfCloseHandler(RequestHandler):
    """aiohttp's request handler, answering a request whose client half-closed before
    its body was whole (see the module)."""

    __slots__ = ()

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio: bool | None
        """The client sent EOF. A body still expected ends there (its reader sees a short
        body) and the connection stays open for the answer, then closes. Otherwise it
        closes now, as aiohttp's does: a client that left a whole request cancels it.

        Returns:
            True to keep the writing half open (a body was cut, or a request is between
            aiohttp's queue and its handler: decided on the next turn of the loop).
        """
        if self._cut_bodies():
            return True
        waiter = getattr(self, "_waiter", None)
        if (getattr(self, "_current_request", None) is None
                and not getattr(self, "_messages", ())
                and (waiter is None or waiter.done())):
            # a request taken off the queue whose handler task has not run yet: its
            # first step comes before this callback
            asyncio.get_running_loop().call_soon(self._after_eof)
            return True
        return False

    def _cut_bodies(self) -> bool:
        """End every request body still expected; whether there was one."""
        current = getattr(self, "_current_request", None)
        payloads = [payload for _, payload in getattr(self, "_messages", ())]
        if current is not None:
            payloads.append(current.content)
        cut = [p for p in payloads if not p.is_eof()]
        if cut:
            self.close()  # no request after these: the client has nothing more to send
        for payload in cut:
            payload.feed_eof()
        return bool(cut)

    def _after_eof(self) -> None:
        if not self._cut_bodies() and self.transport is not None:
            self.transport.close()  # what the EOF would have done: the client left


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = HalfCloseHandler  # same slots: only eof_received differs
        return handler


class ProxyRunner(web.AppRunner):
    """:class:`aiohttp.web.AppRunner` whose connections use :class:`HalfCloseHandler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        return server
