"""Server-sent events: the response type every stream of this server uses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse


class EventStream(StreamingResponse):
    """A server-sent-events response that always runs ``on_close`` when it ends, whether it
    finished, failed, or the client went away (then ``send`` raises ``OSError``)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def sse(obj: dict[str, Any]) -> str:
    """One ``data:`` event holding ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
