"""Client fan-out (issue 16): kept-alive connections, prompts not tokenized again, the agent's prompt counts."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from memagent.backends.keepalive import KeepAliveTransport
from memagent.backends.openai_compat import OpenAIBackend
from memagent.errors import PromptTruncated
from memagent.tokenization import ByteTokenizer
from memagent.types import Message, Request


@pytest.fixture(scope="module")
def fake_url():
    proc = subprocess.Popen([sys.executable, "-m", "memagent.backends.fakeserver", "--latency", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline().split()[-1])}/v1"
    finally:
        proc.kill()
        proc.wait()


def test_each_thread_keeps_one_connection_per_server(fake_url):
    transport = KeepAliveTransport()
    client = httpx.Client(transport=transport)
    for _ in range(5):
        assert client.get(f"{fake_url}/models").status_code == 200
    assert len(transport._all) == 1  # five requests, one connection
    threads = [threading.Thread(target=lambda: client.get(f"{fake_url}/models")) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(transport._all) == 1  # one more per thread, closed when the thread ended (no socket piles up)
    held, done = threading.Event(), threading.Event()

    def hold():
        client.get(f"{fake_url}/models")
        held.set()
        done.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    assert len(transport._all) == 2  # a thread that is still there keeps its connection
    (kept,) = [c for c in transport._all if c is not next(iter(transport._local.conns.values()))]
    done.set()
    t.join()
    del t
    assert kept.sock is None  # closed when its thread ended, not left for the garbage collector
    del kept
    assert len(transport._all) == 1
    (conn,) = transport._local.conns.values()
    conn.sock.shutdown(socket.SHUT_RDWR)  # the connection dies while idle: reopened, the request goes through
    assert client.get(fake_url.removesuffix("/v1") + "/stats").json()["served"] == 0  # no chat request yet
    transport.close()
    assert len(transport._all) == 0


def test_refused_and_timed_out_connections_are_httpx_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = httpx.Client(transport=KeepAliveTransport())
    with pytest.raises(httpx.ConnectError, match="connection refused"):
        client.get(f"http://127.0.0.1:{port}/v1/models")
    with socket.socket() as listener:  # accepts the connection but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(httpx.ReadTimeout):
            client.get(f"http://127.0.0.1:{listener.getsockname()[1]}/x", timeout=0.2)


class Counting(ByteTokenizer):
    def __init__(self):
        self.texts = []

    def encode(self, text):
        self.texts.append(text)
        return super().encode(text)


def _answer(prompt_tokens):
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1}}
    return httpx.MockTransport(lambda r: httpx.Response(200, json=body))


def test_the_agents_count_spares_tokenizing_the_prompt_again():
    tok = Counting()
    msgs = (Message("user", "a" * 1000),)
    b = OpenAIBackend("http://h/v1", "m", tokenizer=tok, transport=_answer(990), api_key_env="MEMAGENT_UNSET")
    (c,) = b.generate([Request(msgs, 4, request_id="s/0", content_tokens=1000)])
    assert c.finish_reason == "stop" and tok.texts == []  # checked against 1000 (slack 16 + 50): not cut
    (c,) = b.generate([Request(msgs, 4, request_id="s/1")])
    assert tok.texts == ["a" * 1000]  # no count sent: the backend counts itself
    cut = OpenAIBackend("http://h/v1", "m", tokenizer=tok, transport=_answer(500), api_key_env="MEMAGENT_UNSET")
    (c,) = cut.generate([Request(msgs, 4, request_id="s/2", content_tokens=1000)])
    assert c.finish_reason == "error" and c.error.startswith(PromptTruncated.__name__)


def test_agent_content_counts_stay_at_or_below_the_truth():
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend

    backend = ScriptedBackend(batched=False)
    tok = ByteTokenizer()
    doc = "".join(f"Fact {k}: the value is {k * 3}. " for k in range(300))
    MemoryAgent(backend, AgentConfig(chunk_tokens=700, slack_tokens=16)).answer("What is the value of fact 7?", doc)
    reqs = [r for call in backend.calls for r in call]
    assert len(reqs) == 13 and {r.affinity for r in reqs} == {"0"}  # 8252 bytes: 12 chunks of 700, then the final
    for r in reqs:
        truth = sum(len(tok.encode(m.content)) for m in r.messages)
        assert truth - 16 <= r.content_tokens <= truth, (r.request_id, r.content_tokens, truth)


def test_a_request_the_server_drops_is_not_sent_again_by_the_transport():
    """The second request on a kept connection is read by the server, which then closes without answering: the
    transport raises instead of sending it again (only the backend's retries may), and an idle connection the
    server closed is replaced before the next request goes out."""
    import socketserver

    seen = []

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            while True:
                line = self.rfile.readline()
                if not line:
                    return
                while self.rfile.readline() not in (b"\r\n", b""):
                    pass
                seen.append(line.split()[1].decode())
                if line.split()[1] == b"/drop":
                    return  # read, then closed without an answer
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                if line.split()[1] == b"/bye":
                    return  # answered, then closed while idle

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    client = httpx.Client(transport=KeepAliveTransport())
    try:
        assert client.get(f"{url}/a").text == "ok"
        with pytest.raises(httpx.RemoteProtocolError):
            client.get(f"{url}/drop")
        assert seen == ["/a", "/drop"]  # sent once
        assert client.get(f"{url}/bye").text == "ok"
        time.sleep(0.2)  # the server has closed the idle connection
        assert client.get(f"{url}/c").text == "ok" and seen == ["/a", "/drop", "/bye", "/c"]
    finally:
        client.close()
        server.shutdown()
        server.server_close()
