"""A fake OpenAI-compatible chat server: fixed latency, unlimited parallelism, loopback only.

For benchmarks and tests of the client side (fan-out, several endpoints, failover): every request is answered
after ``latency_s`` seconds, whatever the number in flight (an ideal batching server). An update prompt (one
holding a ``<section>``) gets a short memory, any other prompt a boxed answer. ``usage`` is left out, so the
client's prompt-length check is skipped. Served: ``GET /v1/models``, ``POST /v1/chat/completions``, and
``GET /stats`` (requests answered so far, as JSON). HTTP/1.1 with keep-alive, on asyncio streams.

For training rollouts on servers it also takes vLLM's run-time LoRA calls (``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``: the folder must hold an ``adapter_config.json``; once an adapter has been loaded, a
request naming an unknown model gets vLLM's 404), and with a tokenizer it answers ``return_token_ids`` requests
with ``prompt_token_ids`` (of the messages' contents joined, not a real chat template) and ``token_ids`` (the
reply's tokens and the end-of-sequence id). ``--strict-models`` refuses an unknown model name from the start
(a restarted vLLM server that has not been given the adapter yet).

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
        tokenizer: ``encode(text) -> list[int]`` for ``return_token_ids`` answers (``None``: no token ids).
        eos_id: the end-of-sequence id appended to ``token_ids``.

    Attributes:
        adapters: loaded LoRA adapter name -> folder.
        by_model: answered chat requests per requested model name.
    """

    def __init__(self, latency_s: float = 0.5, model: str = "fake", tokenizer=None, eos_id: int = 0,
                 strict_models: bool = False):
        self.latency_s, self.model, self.strict_models = latency_s, model, strict_models
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.served = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.adapters: dict[str, str] = {}
        self.lora_loads: list[str] = []
        self.by_model: dict[str, int] = {}

    def _lora(self, path: str, body: bytes) -> tuple[int, dict]:
        import os

        try:
            req = json.loads(body)
            name = req["lora_name"]
        except (ValueError, KeyError, TypeError):
            return 400, {"error": {"message": "expected {lora_name, lora_path}"}}
        if path.endswith("/unload_lora_adapter"):
            if self.adapters.pop(name, None) is None:
                return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}}
            return 200, {"message": f"Success: LoRA adapter '{name}' removed successfully."}
        folder = req.get("lora_path", "")
        if name in self.adapters:
            return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            return 400, {"error": {"message": f"No adapter found for {folder}"}}
        self.adapters[name] = folder
        self.lora_loads.append(name)
        return 200, {"message": f"Success: LoRA adapter '{name}' added successfully."}

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if method == "GET" and path.rstrip("/") in ("/v1/models", "/models"):  # with the loaded adapters, as vLLM
            return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in (self.model, *self.adapters)]}
        if method == "GET" and path == "/stats":
            return 200, {"served": self.served, "max_in_flight": self.max_in_flight, "by_model": self.by_model,
                         "adapters": sorted(self.adapters)}
        if method == "POST" and path.rstrip("/").endswith(("/load_lora_adapter", "/unload_lora_adapter")):
            return self._lora(path.rstrip("/"), body)
        if method != "POST" or not path.rstrip("/").endswith("/chat/completions"):
            return 404, {"error": {"message": f"no route {method} {path}"}}
        try:
            req = json.loads(body)
            messages = req["messages"]
            prompt = messages[-1]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return 400, {"error": {"message": "expected a chat completions body"}}
        model = req.get("model", self.model)
        if (self.lora_loads or self.strict_models) and model != self.model and model not in self.adapters:
            return 404, {"error": {"message": f"The model `{model}` does not exist.", "code": 404}}
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)
        finally:
            self.in_flight -= 1
        self.served += 1
        self.by_model[model] = self.by_model.get(model, 0) + 1
        text = "Memory: nothing relevant so far." if "<section>" in prompt else "\\boxed{fake}"
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        out = {"id": f"fake-{self.served}", "object": "chat.completion", "model": model, "choices": [choice]}
        if req.get("return_token_ids") and self.tokenizer is not None:
            out["prompt_token_ids"] = list(self.tokenizer("\n".join(str(m.get("content", "")) for m in messages)))
            choice["token_ids"] = [*self.tokenizer(text), self.eos_id]
        return 200, out

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


def file_tokenizer(path: str):
    """``encode(text) -> list[int]`` of a ``tokenizer.json`` file (no special tokens added)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


async def serve(port: int, latency_s: float, host: str = "127.0.0.1", tokenizer: str | None = None,
                eos_id: int = 0, strict_models: bool = False) -> None:
    """Listen on ``host:port`` (0: any free port) and print ``listening on <port>`` once ready; ``tokenizer``: a
    ``tokenizer.json`` for ``return_token_ids`` answers."""
    server = FakeServer(latency_s, tokenizer=file_tokenizer(tokenizer) if tokenizer else None, eos_id=eos_id,
                        strict_models=strict_models)
    srv = await asyncio.start_server(server.handle, host, port, backlog=4096)
    print(f"listening on {srv.sockets[0].getsockname()[1]}", flush=True)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one, printed)")
    ap.add_argument("--latency", type=float, default=0.5, help="seconds before each answer")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json: answer return_token_ids requests with ids")
    ap.add_argument("--eos-id", type=int, default=0, help="the end-of-sequence id appended to token_ids")
    ap.add_argument("--strict-models", action="store_true", help="404 for a model name it does not serve, from the start")
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.port, args.latency, tokenizer=args.tokenizer, eos_id=args.eos_id,
                          strict_models=args.strict_models))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
