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


# Characters Python's str.splitlines (and so httpx's iter_lines) ends a line at that JSON leaves
# raw in a string; every other line end (\n, \r, \x0b, \x0c, \x1c-\x1e) JSON escapes already.
_LINE_BREAKS_LEFT_RAW = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict[str, Any]) -> str:
    """One ``data:`` event holding ``obj`` as JSON on a single line, whatever text it holds:
    characters some clients split lines at (U+0085, U+2028, U+2029) are written as escapes."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS_LEFT_RAW)}\n\n"
