"""A fake OpenAI-compatible chat server: fixed latency, unlimited parallelism, loopback only.

For benchmarks and tests of the client side (fan-out, several endpoints, failover): every request is answered
after ``latency_s`` seconds, whatever the number in flight (an ideal batching server). An update prompt (one
holding a ``<section>``) gets a short memory, any other prompt a boxed answer. ``usage`` is left out, so the
client's prompt-length check is skipped. Served: ``GET /v1/models``, ``POST /v1/chat/completions``, and
``GET /stats`` (requests answered so far, as JSON). HTTP/1.1 with keep-alive, on asyncio streams.

Run::

    python -m memagent.backends.fakeserver --port 8001 --latency 0.5   # prints "listening on <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import json

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found"}


class FakeServer:
    """The server's state and request handling.

    Args:
        latency_s: seconds before each chat answer.
        model: the model name listed by ``/v1/models``.
    """

    def __init__(self, latency_s: float = 0.5, model: str = "fake"):
        self.latency_s, self.model = latency_s, model
        self.served = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if method == "GET" and path.rstrip("/") in ("/v1/models", "/models"):
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        if method == "GET" and path == "/stats":
            return 200, {"served": self.served, "max_in_flight": self.max_in_flight}
        if method != "POST" or not path.rstrip("/").endswith("/chat/completions"):
            return 404, {"error": {"message": f"no route {method} {path}"}}
        try:
            messages = json.loads(body)["messages"]
            prompt = messages[-1]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return 400, {"error": {"message": "expected a chat completions body"}}
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
        self.served += 1
        text = "Memory: nothing relevant so far." if "<section>" in prompt else "\\boxed{fake}"
        return 200, {"id": f"fake-{self.served}", "object": "chat.completion", "model": self.model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "stop"}]}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection until the client closes it."""
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                status, payload = await self._answer(method, path, body)
                data = json.dumps(payload).encode()
                writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


async def serve(port: int, latency_s: float, host: str = "127.0.0.1") -> None:
    """Listen on ``host:port`` (0: any free port) and print ``listening on <port>`` once ready."""
    server = FakeServer(latency_s)
    srv = await asyncio.start_server(server.handle, host, port, backlog=4096)
    print(f"listening on {srv.sockets[0].getsockname()[1]}", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one, printed)")
    ap.add_argument("--latency", type=float, default=0.5, help="seconds before each answer")
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.port, args.latency))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
