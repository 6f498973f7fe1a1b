"""Server-sent events framing and the streaming response that carries them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

SSE_HEADERS = {
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # tell nginx and friends not to buffer the stream
}


def event(data: dict[str, Any] | str, name: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {payload}\n\n".encode()


def comment(text: str = "keep-alive") -> bytes:
    return f": {text}\n\n".encode()




class EventStream(StreamingResponse):
    """A streaming response that notices a client leaving even while nothing is being sent,
    and always closes its body iterator (which aborts the request in the worker)."""

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        import anyio

        try:
            async with anyio.create_task_group() as group:
                async def pump() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-send
                        pass
                    finally:
                        group.cancel_scope.cancel()

                group.start_soon(pump)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


def streaming_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    return EventStream(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
