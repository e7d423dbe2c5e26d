"""Several replicas of one served model: least-loaded routing, affinity, health, failover.

:class:`EndpointPool` picks the endpoint for each attempt of a request: the one with the fewest requests in
flight, except that requests sharing an affinity key (the agent uses the sample id, so one sample's calls and
one RL group's) go back to the endpoint that served the key before while it is up and not much busier than
the least-loaded one, so the server's prefix cache hits. An endpoint whose connection fails leaves the
rotation; it is probed again (``GET /models``) every ``recheck_s`` seconds, and comes back when it answers.
When no endpoint is up, :meth:`EndpointPool.acquire` probes them all at once before giving up.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from memagent.errors import BackendError, ConfigError

# The endpoints memagent appends to the API root (a base_url copied with one of them is refused).
_ENDPOINT_PATH = re.compile(r"/(chat/completions|completions|models)$")

#: Affinity keys remembered (least recently used forgotten first).
AFFINITY_KEYS = 1 << 16


class EndpointsDown(BackendError):
    """No endpoint of a backend answers: the run stops (rows already written stay)."""


@dataclass
class Endpoint:
    """One server and its counts.

    Attributes:
        url: the API root (``http://host:port/v1``).
        in_flight: requests sent and not answered yet.
        requests: answered requests (any HTTP status).
        failed: attempts that failed to connect or lost the connection.
        up: in the rotation.
        down_since: when it left the rotation (``time.monotonic()``).
        last_error: why it left.
    """

    url: str
    in_flight: int = 0
    requests: int = 0
    failed: int = 0
    up: bool = True
    down_since: float = 0.0
    last_error: str = ""
    probing: bool = field(default=False, repr=False)


class EndpointPool:
    """Routes attempts across endpoints (see the module docstring).

    Args:
        urls: the endpoints' API roots, in the order given (ties go to the earlier one).
        probe: ``probe(url) -> None`` raises when the endpoint does not answer (a health check).
        recheck_s: seconds before a down endpoint is probed again.
        affinity_slack: a key's endpoint is kept while it has at most this many more requests in flight than
            the least-loaded one.
        on_leave: ``on_leave(endpoint, why)``, called when an endpoint leaves the rotation during a run while
            others stay up (the backend warns there, so a user sees it when it happens).
    """

    def __init__(self, urls: Sequence[str], probe: Callable[[str], None], recheck_s: float = 5.0,
                 affinity_slack: int = 4, on_leave: Callable[[Endpoint, str], None] | None = None):
        self.endpoints = [Endpoint(u) for u in urls]
        self._on_leave = on_leave
        self._probe, self.recheck_s, self.affinity_slack = probe, recheck_s, affinity_slack
        self._lock = threading.Lock()
        self._affinity: OrderedDict[str, Endpoint] = OrderedDict()

    def acquire(self, affinity: str | None = None, avoid: Endpoint | None = None) -> Endpoint:
        """The endpoint for the next attempt (its ``in_flight`` counted); release it with :meth:`release`.

        Args:
            affinity: the request's affinity key (see the module docstring).
            avoid: an endpoint not to use while another is up (a retry after it answered with an error: a
                replica that fails fast would otherwise look least loaded and get the retry again).

        Raises:
            EndpointsDown: no endpoint is up, even after probing every one.
        """
        self._recheck(only_due=True)
        ep = self._pick(affinity, avoid)
        if ep is None:
            self.recheck()
            ep = self._pick(affinity, avoid)
        if ep is None:
            raise EndpointsDown(self.down_message())
        return ep

    def _pick(self, affinity: str | None, avoid: Endpoint | None = None) -> Endpoint | None:
        with self._lock:
            up = [e for e in self.endpoints if e.up]
            if not up:
                return None
            if avoid is not None and len(up) > 1:
                up = [e for e in up if e is not avoid] or up
            best = min(up, key=lambda e: e.in_flight)
            ep = self._affinity.get(affinity) if affinity is not None else None
            if ep is None or ep not in up or ep.in_flight > best.in_flight + self.affinity_slack:
                ep = best
            if affinity is not None:
                self._affinity[affinity] = ep
                self._affinity.move_to_end(affinity)
                if len(self._affinity) > AFFINITY_KEYS:
                    self._affinity.popitem(last=False)
            ep.in_flight += 1
            return ep

    def release(self, ep: Endpoint, answered: bool) -> None:
        """End an attempt: ``answered`` counts a request; else a failed attempt (no answer, or an answer with a
        retryable error status)."""
        with self._lock:
            ep.in_flight -= 1
            if answered:
                ep.requests += 1
            else:
                ep.failed += 1

    def mark_down(self, ep: Endpoint, why: str, quiet: bool = False) -> bool:
        """Take ``ep`` out of the rotation; returns whether another endpoint is still up. When ``ep`` leaves
        while others stay up, ``on_leave(ep, why)`` is called (unless ``quiet``: the caller says so itself)."""
        with self._lock:
            left = ep.up
            if ep.up:
                ep.up, ep.down_since, ep.last_error = False, time.monotonic(), why
            others = any(e.up for e in self.endpoints)
        if left and others and not quiet and self._on_leave is not None:
            self._on_leave(ep, why)
        return others

    def any_up(self) -> bool:
        with self._lock:
            return any(e.up for e in self.endpoints)

    def recheck(self) -> bool:
        """Probe every down endpoint now; returns whether any endpoint is up afterwards."""
        self._recheck(only_due=False)
        return self.any_up()

    def _recheck(self, only_due: bool) -> None:
        """Probe the down endpoints (``only_due``: those down for ``recheck_s``), one thread per endpoint."""
        now = time.monotonic()
        with self._lock:
            due = [e for e in self.endpoints if not e.up and not e.probing
                   and (not only_due or now - e.down_since >= self.recheck_s)]
            for e in due:
                e.probing = True
        for e in due:
            try:
                self._probe(e.url)
                ok, why = True, ""
            except Exception as err:  # any failure of the probe keeps it down
                ok, why = False, f"{type(err).__name__}: {err}"
            with self._lock:
                e.probing = False
                if ok:
                    e.up = True
                else:
                    e.down_since, e.last_error = time.monotonic(), why or e.last_error

    def down_message(self) -> str:
        with self._lock:
            parts = "; ".join(f"{e.url} ({e.last_error or 'down'})" for e in self.endpoints)
        n = len(self.endpoints)
        what = "the server does not answer" if n == 1 else f"none of the {n} servers answers"
        return (f"{what}: {parts}. The run stops here; rows already written are kept: start the server(s) and "
                "rerun with --resume (memagent run) or the same command (memagent eval)")

    def stats(self) -> dict[str, dict[str, int | bool]]:
        """Per endpoint: answered requests, failed attempts, whether it is up."""
        with self._lock:
            return {e.url: {"requests": e.requests, "failed": e.failed, "up": e.up} for e in self.endpoints}


def describe_stats(stats: dict[str, dict[str, int | bool]]) -> str:
    """One line for a run's summary: answered requests per endpoint, with failed attempts and the endpoints
    out of the rotation at the end (:meth:`EndpointPool.stats`)."""
    parts = []
    for url, s in stats.items():
        notes = [f"{s['failed']} failed attempt{'s' if s['failed'] != 1 else ''}"] if s["failed"] else []
        if not s["up"]:
            notes.append("out of the rotation")
        parts.append(f"{url} {s['requests']}" + (f" ({', '.join(notes)})" if notes else ""))
    return "requests per server: " + ", ".join(parts)


def check_base_url(url: object) -> None:
    """Refuse a server URL that cannot be requested, before any request.

    Raises:
        ConfigError: ``url`` is not a string, lacks ``http://`` / ``https://``, has no host, holds whitespace,
            has a port that is not a number in 1-65535, or ends with an endpoint (``/chat/completions``,
            ``/completions``, ``/models``) instead of the API root (names the URL and the ``--base-url`` option).
    """
    fix = "give --base-url (base_url) as http://HOST:PORT/v1"
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"base_url {url!r} must start with http:// or https://; {fix}")
    if url != url.strip() or any(c.isspace() for c in url):
        raise ConfigError(f"base_url {url!r} holds whitespace; {fix}")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ConfigError(f"base_url {url!r} is not a valid URL ({e}); {fix}") from None
    if not parsed.host:
        raise ConfigError(f"base_url {url!r} names no host; {fix}")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ConfigError(f"base_url {url!r}: port {parsed.port} is outside 1-65535; {fix}")
    trimmed = url.rstrip("/")
    # in the path only: a host named `models` (http://models, an API at the server's root) is no endpoint
    has_path = trimmed.find("/", trimmed.index("//") + 2) >= 0
    endpoint = _ENDPOINT_PATH.search(trimmed) if has_path else None
    if endpoint:  # the pre-flight cannot tell: GET .../chat/completions/models is a 404, as on a server without a listing
        raise ConfigError(f"base_url {url!r} names an endpoint, not the API root: give --base-url "
                          f"{trimmed[:endpoint.start()]} (memagent adds /chat/completions and /models itself)")
