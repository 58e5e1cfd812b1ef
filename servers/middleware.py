"""Plain ASGI middlewares in front of the app (Starlette's BaseHTTPMiddleware would pass every streamed chunk through
extra tasks and memory streams): the API key, and the request body's size limit."""
from servers.protocol import error


class ApiKey:
    """/v1/ requests without `Authorization: Bearer <key>` get 401."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                dict(scope["headers"]).get(b"authorization", b"") != self.expected:
            response = error(401, "invalid or missing API key (Authorization: Bearer ...)", None,
                             "authentication_error", "invalid_api_key")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """A request body over `limit` bytes gets 413 naming the limit: at once when its
    Content-Length says so, else as soon as the bytes read pass it (chunked); nothing over the limit is held."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await self.refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > self.limit:
                return await self.refuse(scope, receive, send)
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # after the body: wait for the disconnect, as the server would
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)

    async def refuse(self, scope, receive, send):
        await error(413, f"the request body is over the server's limit of {self.limit} bytes (server.max_body_bytes)",
                    None, code="request_too_large", headers={"Connection": "close"})(scope, receive, send)
