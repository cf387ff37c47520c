"""A cap on request body size, checked before anything parses the body.

A body over the cap is answered 413 with an OpenAI-style error naming the limit: at once when
Content-Length says so, else as soon as the streamed bytes pass it (the rest is never read). A body
within the cap is read here and handed on whole.
"""
from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
FLAG = "--max-request-body-bytes"


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"{FLAG} must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, f"{int(declared)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":     # the client left before sending it all
                return await self.app(scope, _replay([message], receive), send)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send, f"more than {self.max_bytes} bytes")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps({"error": {
            "message": f"request body is {size}, over the server's limit of {self.max_bytes} bytes "
                       f"(set by {FLAG})",
            "type": "invalid_request_error", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], receive):
    """A receive() that returns `messages` first, then defers to the real one (disconnects)."""
    pending = list(messages)

    async def replay():
        return pending.pop(0) if pending else await receive()

    return replay
