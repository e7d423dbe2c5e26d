"""Several servers (issue 16): least-loaded routing with affinity, failover without a lost or doubled sample,
health checks, every server down."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from memagent.backends.endpoints import EndpointPool, EndpointsDown, describe_stats
from memagent.backends.openai_compat import OpenAIBackend
from memagent.errors import BackendError
from memagent.types import Message, Request

A, B = "http://a:1/v1", "http://b:2/v1"


def _ok(text="ok"):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


class Servers:
    """A MockTransport handler for several hosts; a host in ``dead`` refuses connections."""

    def __init__(self, dead=(), delay_s=0.0, hung=(), slow=()):
        self.dead, self.delay_s = set(dead), delay_s
        self.hung, self.slow = set(hung), set(slow)  # hung: nothing answers; slow: only its completions time out
        self.posts: list[tuple[str, str]] = []  # (host, request id from the prompt)
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused")
        if host in self.hung or (host in self.slow and request.method == "POST"):
            raise httpx.ReadTimeout("timed out")
        if request.method == "GET":
            return httpx.Response(200, json={"data": []})
        rid = json.loads(request.content)["messages"][-1]["content"]
        with self.lock:
            self.posts.append((host, rid))
        time.sleep(self.delay_s)
        return httpx.Response(200, json=_ok(f"{host}:{rid}"))


def _backend(servers, urls=(A, B), **kw):
    kw.setdefault("retry_wait_s", 0.001)
    return OpenAIBackend(list(urls), "m", transport=httpx.MockTransport(servers), api_key_env="MEMAGENT_UNSET", **kw)


def _req(rid, affinity=None):
    return Request((Message("user", rid),), max_tokens=4, request_id=rid, affinity=affinity)


def test_pool_picks_the_least_loaded_and_keeps_a_key_on_its_endpoint():
    pool = EndpointPool([A, B], probe=lambda url: None, affinity_slack=1)
    a1 = pool.acquire("s1")
    b1 = pool.acquire("s2")
    assert (a1.url, b1.url) == (A, B)  # a tie goes to the first; then the idle one
    assert [pool.acquire("s1").url for _ in range(2)] == [A, A]  # back to A while it has at most 1 more than B
    assert pool.acquire("s1").url == B  # A has 3 in flight against B's 1: over the slack, the least-loaded wins
    assert pool.acquire("s1").url == B  # ...and s1 now prefers B (2 in flight, A 3)
    assert [e.in_flight for e in pool.endpoints] == [3, 3]
    for ep in pool.endpoints:
        for _ in range(ep.in_flight):
            pool.release(ep, answered=True)
    pool.release(pool.acquire(), answered=False)  # an attempt on A (a tie again) that failed
    assert pool.stats() == {A: {"requests": 3, "failed": 1, "up": True}, B: {"requests": 3, "failed": 0, "up": True}}


def test_a_down_endpoint_is_probed_again_and_comes_back():
    alive = {A: True, B: False}

    def probe(url):
        if not alive[url]:
            raise ConnectionError("refused")

    pool = EndpointPool([A, B], probe=probe, recheck_s=0.0)
    assert pool.mark_down(pool.endpoints[1], "ConnectError") is True
    assert pool.acquire().url == A and pool.endpoints[1].up is False  # probed, still refusing
    alive[B] = True
    pool.acquire()
    assert pool.endpoints[1].up is True
    alive[A] = alive[B] = False
    for ep in pool.endpoints:
        pool.mark_down(ep, "ConnectError: refused")
    with pytest.raises(EndpointsDown, match=r"none of the 2 servers answers: http://a:1/v1 \(ConnectionError: refused\)"):
        pool.acquire()


def test_requests_spread_over_two_servers_and_one_sample_stays_on_one():
    servers = Servers(delay_s=0.01)
    b = _backend(servers, concurrency=8)
    reqs = [_req(f"s{k}/chunk{t}", affinity=f"s{k}") for t in range(3) for k in range(8)]
    for t in range(3):  # turns of 8 samples in flight together, as the agent sends them
        out = b.generate(reqs[8 * t: 8 * t + 8])
        assert all(c.finish_reason == "stop" for c in out)
    hosts = {}
    for host, rid in servers.posts:
        hosts.setdefault(rid.split("/")[0], set()).add(host)
    assert all(len(h) == 1 for h in hosts.values())  # each sample's calls on one server (its prefix cache)
    counts = b.endpoint_stats()
    assert counts[A]["requests"] + counts[B]["requests"] == 24 and min(counts[A]["requests"], counts[B]["requests"]) >= 6


def test_a_dead_server_leaves_the_rotation_and_its_request_moves_at_once():
    servers = Servers(dead={"a"})
    b = _backend(servers, max_retries=0, retry_wait_s=5.0)  # a backoff would take 5 s; a failover takes none
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match=r"^server http://a:1/v1 left the rotation \(ConnectError: connection refused\); "
                      r"its requests go to the other servers, and it is probed again every 5 s$"):
        (c,) = b.generate([_req("s1/chunk0", affinity="s1")])
    assert c.text == "b:s1/chunk0" and time.perf_counter() - t0 < 2  # retried on b although max_retries=0
    assert b.endpoint_stats() == {A: {"requests": 0, "failed": 1, "up": False}, B: {"requests": 1, "failed": 0, "up": True}}
    assert describe_stats(b.endpoint_stats()) == ("requests per server: http://a:1/v1 0 (1 failed attempt, out of "
                                                  "the rotation), http://b:2/v1 1")
    (c,) = b.generate([_req("s2/chunk0")])
    assert c.text == "b:s2/chunk0" and servers.posts == [("b", "s1/chunk0"), ("b", "s2/chunk0")]


def test_a_hung_server_leaves_the_rotation_after_a_read_timeout_and_its_request_moves():
    servers = Servers(hung={"a"})  # accepts connections, answers neither completions nor health checks
    b = _backend(servers, max_retries=0)
    with pytest.warns(UserWarning, match=r"server http://a:1/v1 left the rotation \(ReadTimeout, and its health check"):
        (c,) = b.generate([_req("s1/chunk0", affinity="s1")])
    assert c.text == "b:s1/chunk0"  # moved at once although max_retries=0
    assert b.endpoint_stats() == {A: {"requests": 0, "failed": 1, "up": False}, B: {"requests": 1, "failed": 0, "up": True}}


def test_a_slow_server_that_answers_its_health_check_stays_in_the_rotation():
    servers = Servers(slow={"a"})  # its completions time out, its health check answers: a long request, not a hang
    b = _backend(servers, max_retries=1)
    (c,) = b.generate([_req("s1/chunk0", affinity="s1")])  # the retry goes to the other replica
    assert c.finish_reason == "stop" and servers.posts == [("b", "s1/chunk0")]
    assert b.endpoint_stats()[A] == {"requests": 0, "failed": 1, "up": True}
    (c,) = _backend(servers, urls=(A,), max_retries=1).generate([_req("s1/chunk0", affinity="s1")])  # alone: retried
    assert c.finish_reason == "error" and "no answer from http://a:1/v1 in time (ReadTimeout) (after 2 attempts)" in c.error


def test_retries_of_an_error_answer_go_to_another_replica_and_count_as_failed():
    """A replica that answers 500 at once looks least loaded; the retry goes to the other one, the error names the
    replica, and its answers count as failed attempts in the run's summary."""
    def handler(request):
        if request.url.host == "a" and request.method == "POST":
            return httpx.Response(500, json={"error": {"message": "internal error"}})
        return Servers()(request)

    b = OpenAIBackend([A, B], "m", transport=httpx.MockTransport(handler), api_key_env="MEMAGENT_UNSET",
                      retry_wait_s=0.001, max_retries=2)
    comps = b.generate([_req(f"s{k}/chunk0", affinity=f"s{k}") for k in range(6)])
    assert [c.finish_reason for c in comps] == ["stop"] * 6
    stats = b.endpoint_stats()
    assert stats[B]["requests"] == 6 and stats[A]["requests"] == 0 and stats[A]["failed"] >= 1
    assert "failed attempt" in describe_stats(stats).split(", ")[0]
    (c,) = OpenAIBackend([A], "m", transport=httpx.MockTransport(handler), api_key_env="MEMAGENT_UNSET",
                         retry_wait_s=0.001, max_retries=1).generate([_req("s9/chunk0")])
    assert c.error == "BackendError: [request s9/chunk0] HTTP 500 from http://a:1/v1: internal error (after 2 attempts)"


def test_a_request_the_server_drops_is_one_error_row_while_its_health_check_answers():
    """A single server that closes the connection on one request (and answers GET /models) is there: that
    request fails as an error completion, the run goes on; a server that does not answer its health check either
    stops the run."""
    def handler(request):
        if request.method == "POST" and b"poison" in request.content:
            raise httpx.ReadError("IncompleteRead(10 bytes read)")
        return Servers()(request)

    b = OpenAIBackend([A], "m", transport=httpx.MockTransport(handler), api_key_env="MEMAGENT_UNSET",
                      retry_wait_s=0.001, max_retries=1)
    comps = b.generate([_req("ok/1"), _req("poison/1"), _req("ok/2")])
    assert [c.finish_reason for c in comps] == ["stop", "error", "stop"]
    assert "cannot reach http://a:1/v1: ReadError: IncompleteRead(10 bytes read) (after 2 attempts)" in comps[1].error
    assert b.endpoint_stats()[A]["up"]
    dead = OpenAIBackend([A], "m", transport=httpx.MockTransport(Servers(hung={"a"})), api_key_env="MEMAGENT_UNSET",
                         retry_wait_s=0.001, max_retries=1)
    with pytest.raises(EndpointsDown, match="the server does not answer: http://a:1/v1"):
        dead.generate([_req("s/1")])  # a hung single server stops the run, as a dead one does


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:abc/v1", "is not a valid URL"),
    ("http://[::1/v1", "is not a valid URL"),
    ("http://127.0.0.1:99999/v1", "port 99999 is outside 1-65535"),
    ("http://", "names no host"),
    ("http://h:8000/v1 ", "holds whitespace"),
    ("127.0.0.1:8000/v1", "must start with http:// or https://"),
])
def test_a_bad_base_url_is_refused_before_any_request(url, why):
    from memagent.errors import ConfigError

    with pytest.raises(ConfigError, match=f"base_url .* {why}.*--base-url"):
        _backend(Servers(), urls=(A, url))


def test_unreachable_server_among_several_is_warned_about_and_skipped():
    b = _backend(Servers(dead={"a"}))
    with pytest.warns(UserWarning, match=r"cannot reach http://a:1/v1 \(ConnectError: connection refused\): left out "
                                         r"of the rotation for now"):
        b.check_reachable()
    assert [e.up for e in b.pool.endpoints] == [False, True]
    with pytest.raises(BackendError, match=r"cannot reach http://a:1/v1 \(ConnectError: connection refused\); "
                                           r"http://b:2/v1 \(ConnectError: connection refused\); is the server running"):
        _backend(Servers(dead={"a", "b"})).check_reachable()


def test_every_server_down_raises_naming_them_all():
    b = _backend(Servers(dead={"a", "b"}), max_retries=1)
    with pytest.raises(EndpointsDown, match=r"\[request s1/final\] none of the 2 servers answers: http://a:1/v1 "
                                            r"\(ConnectError: connection refused\); http://b:2/v1"):
        b.generate([_req("s1/final")])


def test_several_base_urls_from_the_command_line_options():
    from memagent.backends.factory import BackendOptions

    two = BackendOptions(backend="openai", model="m", base_url=(A, B)).settings()
    assert two["base_url"] == [A, B] and two["concurrency"] == 256
    one = BackendOptions(backend="openai", model="m", base_url=A).settings()
    assert one["base_url"] == A  # one server: recorded as before


def test_agent_stops_every_sample_when_all_servers_are_down_and_keeps_finished_rows():
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend
    from memagent.types import Sample

    calls = []

    class Dying(ScriptedBackend):
        concurrency = 2

        def generate(self, requests):
            calls.append(requests[0].request_id)
            if len(calls) > 4:
                raise EndpointsDown("none of the 2 servers answers")
            return super().generate(requests)

    done = []
    agent = MemoryAgent(Dying(batched=False), AgentConfig(chunk_tokens=1000))
    samples = [Sample(f"s{k}", "q?", "short document") for k in range(20)]
    with pytest.raises(EndpointsDown, match="none of the 2 servers"):
        agent.run(samples, on_result=lambda s, t: done.append(s.id))
    # 4 calls answered, 2 samples in flight: the finals of s0 and s1 race, so 1 or 2 samples finished (2 calls
    # each) before the first failure; the other 18 samples stopped at once (no call beyond those in flight)
    assert 1 <= len(done) <= 2 and len(calls) <= 7, (done, calls)


def test_the_command_line_prints_memagent_warnings_without_source_lines():
    from pathlib import Path

    import memagent.backends.endpoints as endpoints
    from memagent.cli import _format_warning

    ours = _format_warning(UserWarning("server x left the rotation"), UserWarning, endpoints.__file__, 124, "code")
    assert ours == "warning: server x left the rotation\n"
    theirs = _format_warning(UserWarning("deprecated"), UserWarning, str(Path(pytest.__file__)), 7, "code")
    assert theirs.startswith(str(Path(pytest.__file__))) and "7: UserWarning: deprecated" in theirs


@pytest.mark.parametrize("url, root", [
    ("http://h:8000/v1/chat/completions", "http://h:8000/v1"),
    ("http://h:8000/v1/chat/completions/", "http://h:8000/v1"),
    ("https://api.example.com/v1/completions", "https://api.example.com/v1"),
    ("http://h:8000/v1/models", "http://h:8000/v1"),
])
def test_a_base_url_naming_an_endpoint_is_refused_naming_the_api_root(url, root):
    """A URL copied with its endpoint (`.../v1/chat/completions`): the pre-flight passed (`GET .../models` was a 404,
    which a server without a model listing answers too) and every request went to `.../chat/completions/chat/
    completions`, each sample an error row."""
    from memagent.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _backend(Servers(), urls=(A, url))
    assert str(e.value) == (f"base_url {url!r} names an endpoint, not the API root: give --base-url {root} "
                            "(memagent adds /chat/completions and /models itself)")
    _backend(Servers(), urls=(A, "http://h:8000/completions-proxy/v1"))  # a root that merely contains the word


def test_a_host_named_like_an_endpoint_is_not_an_endpoint():
    """`http://models` (a server named `models` with the API at its root): the endpoint check read the host as the
    path `/models` and refused it, advising `--base-url http:/`."""
    from memagent.backends.endpoints import check_base_url

    for url in ("http://models", "http://completions/", "https://models:8443"):
        check_base_url(url)
    from memagent.errors import ConfigError

    with pytest.raises(ConfigError, match=r"give --base-url http://models \("):
        check_base_url("http://models/models")
