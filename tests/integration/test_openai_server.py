"""OpenAIBackend against a real llama.cpp server on the loopback interface (SmolLM2-135M, CPU)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from memagent.backends import models
from memagent.backends.endpoints import EndpointsDown
from memagent.backends.openai_compat import OpenAIBackend
from memagent.errors import ConfigError
from memagent.types import Message, Request

pytestmark = pytest.mark.slow

N_CTX = 2048
ALIAS = "smol"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _llama_server(tmp_path):
    """Start ``python -m llama_cpp.server`` on 127.0.0.1; yield (process, base_url); always kill it."""
    pytest.importorskip("llama_cpp")
    for dep in ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings"):
        pytest.importorskip(dep, reason="llama-cpp-python[server] extras are not installed")
    try:
        gguf = models.smollm2_gguf_path()
    except ConfigError as e:
        pytest.skip(str(e))
    port = _free_port()
    log_path = tmp_path / f"server-{port}.log"
    # llama_cpp.server run under memagent's loading rule (no AMX buffers on CPUs that report AMX, where its
    # kernels die with SIGILL on some VMs); everything else is the server's own command line
    launch = ("import runpy, sys; from memagent.backends.llamacpp import model_params_for_loading\n"
              "sys.argv[0] = 'llama_cpp.server'\n"
              "with model_params_for_loading(): runpy.run_module('llama_cpp.server', run_name='__main__')")
    cmd = [sys.executable, "-c", launch, "--model", gguf, "--model_alias", ALIAS, "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(N_CTX), "--n_threads", "2", "--n_threads_batch", "2"]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama_cpp.server exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama_cpp.server not ready after 90 s:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        yield proc, base_url
    finally:
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only the server and its children
    proc.wait(timeout=30)


def _ask(text: str, request_id: str, max_tokens: int = 24) -> Request:
    return Request((Message("user", text),), max_tokens=max_tokens, request_id=request_id)


def test_requests_through_a_real_server(tmp_path):
    with _llama_server(tmp_path) as (_, base_url):
        with OpenAIBackend(base_url, ALIAS, api_key_env="MEMAGENT_UNSET_KEY", concurrency=2, timeout_s=60,
                           max_retries=1, retry_wait_s=0.05, context_tokens=N_CTX) as backend:  # fmt: skip
            colors, hello, too_long = backend.generate(
                [
                    _ask("Name three colors.", "c/0"),
                    _ask("Say hello.", "h/0", max_tokens=3),
                    _ask("apple " * 2100, "long/0"),
                ]
            )
    # Same template and greedy decoding as the in-process backend (see test_backend_llamacpp.py).
    assert colors.text == "1. Red\n2. Blue\n3. Green" and colors.finish_reason == "stop"
    assert (colors.usage.prompt_tokens, colors.usage.completion_tokens) == (34, 11)
    assert colors.token_ids is None and colors.seconds > 0
    assert hello.finish_reason == "length" and hello.usage.completion_tokens == 3
    assert too_long.finish_reason == "error"
    assert too_long.error.startswith("ContextOverflow: [request long/0]")
    assert "2048" in too_long.error


class _KillAfterFirst(httpx.BaseTransport):
    """Real HTTP transport that kills the server once the first completion has been received."""

    def __init__(self, proc: subprocess.Popen):
        self.inner = httpx.HTTPTransport()
        self.proc = proc
        self.answered = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()
        self.answered += 1
        if self.answered == 1:
            _kill(self.proc)
        return response

    def close(self) -> None:
        self.inner.close()


def test_server_killed_mid_batch_stops_the_batch_quickly(tmp_path):
    with _llama_server(tmp_path) as (proc, base_url):
        transport = _KillAfterFirst(proc)
        backend = OpenAIBackend(base_url, ALIAS, api_key_env="MEMAGENT_UNSET_KEY", concurrency=1, timeout_s=60,
                                max_retries=2, retry_wait_s=0.05, transport=transport)  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(EndpointsDown, match=rf"\[request s1/0\] the server does not answer: {base_url} "
                           r"\(ConnectError.*The run stops here; rows already written are kept"):
            backend.generate([_ask("Say hello.", f"s{i}/0", max_tokens=4) for i in range(3)])
        backend.close()
    assert proc.poll() is not None
    assert transport.answered == 1
    # Refused connections fail at once: the second request gives up after its backoffs and one health probe.
    assert time.monotonic() - t0 < 30
