"""Any OpenAI-compatible chat-completions server (vLLM, llama.cpp's server, SGLang, hosted APIs).

Split as in lm-evaluation-harness: :func:`build_payload` and :func:`parse_response` (plus
:func:`error_from_http` and :func:`check_prompt_usage`) are pure functions tested on hand-built JSON
(:mod:`memagent.backends.openai_wire`, re-exported here); :class:`OpenAIBackend` is the
transport: a sync ``httpx.Client`` on :class:`memagent.backends.keepalive.KeepAliveTransport` (each calling thread
keeps its connection to each server) shared by the threads that call it, ``concurrency`` requests in flight at most, with tenacity retries (exponential backoff with jitter) on
429, 408, 5xx, connection errors and timeouts. Other 4xx answers are not retried. A request that still fails
comes back as an error completion naming its request id; the rest of the batch goes on. With a tokenizer, an
answer whose ``usage.prompt_tokens`` shows that the server cut the prompt to its window is such an error too
(:func:`check_prompt_usage`; counted from ``Request.content_tokens`` when the agent sent it, so prompts are not
tokenized again).

Several ``base_url``s are replicas of one model (:mod:`memagent.backends.endpoints`): each attempt goes to the
least-loaded one (a sample's calls prefer the endpoint that served it before); an endpoint whose connection
fails leaves the rotation and the attempt moves to another at once; when no endpoint answers any more, the
request raises :class:`EndpointsDown` (the run stops; rows written so far stay).

The API key is read from the environment variable named by ``api_key_env`` (it may be unset for local
servers). It is sent only in the ``Authorization`` header and never appears in reprs, errors or results.

Source: reference doc §2.2-2.3 (the paper evaluates through vLLM's OpenAI chat endpoint with a bounded
number of concurrent samples; it drops failed samples, we record them as errors instead).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import tenacity

from memagent.backends.base import DEFAULT_CHAT_OVERHEAD_TOKENS, check_context_tokens, check_request
from memagent.backends.endpoints import EndpointPool, EndpointsDown, check_base_url
from memagent.backends.keepalive import KeepAliveTransport
from memagent.backends.openai_wire import (  # noqa: F401 - the wire format's public names, re-exported
    PROMPT_USAGE_SLACK_SHARE, PROMPT_USAGE_SLACK_TOKENS, build_payload, check_prompt_usage, error_from_http,
    parse_response)
from memagent.backends.sampling import engine_options
from memagent.errors import BackendError, BackendTimeout, BadResponse, ConfigError, PromptTruncated
from memagent.tokenization import Tokenizer
from memagent.types import Completion, Message, Request, Usage

#: HTTP statuses worth retrying: rate limiting, request timeout, server-side failures.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

#: Requests in flight by default: enough to keep a batching server (vLLM, SGLang) busy.
DEFAULT_CONCURRENCY = 256

#: Transport failures that mean the endpoint is gone (not merely slow): it leaves the rotation.
_GONE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

# Strings that chat templates use as control tokens (ChatML, Llama, Mistral, GPT-2 style end of text).
_CONTROL_LIKE = re.compile(r"<\|[A-Za-z_][A-Za-z0-9_]{0,30}\|>|</?s>|\[/?INST\]")


class _Transient(Exception):
    """Carries a retryable BackendError through tenacity (and the server's Retry-After, in seconds)."""

    def __init__(self, error: BackendError, retry_after_s: float | None = None, failover: bool = False,
                 endpoint=None):
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s
        self.endpoint = endpoint  # the endpoint that failed: a retry goes elsewhere while another is up
        self.failover = failover  # the endpoint left the rotation and another is up: retry there at once


def _retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header given as a number (the HTTP-date form is ignored)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _api_key(env: str) -> str | None:
    """The key in ``$env`` (``None`` when unset or blank), without the surrounding whitespace a key read from a
    file (``$(cat key.txt)``) carries.

    Raises:
        ConfigError: the key holds characters an HTTP header cannot carry (non-ASCII, control characters); the
            message names the variable, never the key.
    """
    key = (os.environ.get(env) or "").strip()
    if not key:
        return None
    if not key.isascii() or any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise ConfigError(f"${env} holds characters an HTTP header cannot carry (non-ASCII letters or control "
                          "characters such as a line break inside the key); check the key (it is not shown here)")
    return key


class OpenAIBackend:
    """A model behind an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        base_url: the API root including its version prefix, e.g. ``http://127.0.0.1:8000/v1``; or a list of
            them, replicas serving the same model.
        model: model name sent in every request.
        api_key_env: environment variable holding the API key; unset or empty sends no key.
        concurrency: requests in flight at once, over all endpoints (the agent keeps this many samples going).
        timeout_s: seconds a server may stay silent before an attempt fails: to connect, and between two reads
            of its answer (an answer that keeps arriving slowly is not cut off).
        max_retries: retries after the first attempt for 429/408/5xx, connection errors and timeouts.
        context_tokens: the model's context window in tokens, when known (chat servers do not report it with
            completions; :meth:`server_context_tokens` asks vLLM for it).
        tokenizer: a tokenizer matching the served model, used by :meth:`count_prompt_tokens` and to check the
            server's ``usage.prompt_tokens`` (:func:`check_prompt_usage`: a prompt the server cut short
            comes back as a :class:`PromptTruncated` error completion). A server that reports no ``usage``
            gets the client's estimate in its place: :meth:`count_prompt_tokens` for the prompt, the answer's
            tokens for the completion (without a tokenizer both stay 0).
        extra_body: extra fields added to every payload (see :func:`build_payload`).
        retry_wait_s: first backoff wait in seconds; it doubles per retry, plus up to ``retry_wait_s`` of
            random jitter.
        retry_max_wait_s: cap on one backoff wait, in seconds.
        chat_overhead_tokens: tokens added for chat-template wrapping by :meth:`count_prompt_tokens`.
        transport: an ``httpx`` transport (tests pass ``httpx.MockTransport``); default
            :class:`memagent.backends.keepalive.KeepAliveTransport` (a kept-alive connection per thread and server).
        recheck_s: seconds before an endpoint out of the rotation is probed again.

    Attributes:
        name: ``"openai:<model>"``.
        batched: False: requests run concurrently, one HTTP call each.

    Raises:
        ConfigError: a setting is out of range.
    """

    batched = False

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout_s: float = 600,
        max_retries: int = 4,
        context_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
        extra_body: dict[str, Any] | None = None,
        retry_wait_s: float = 1.0,
        retry_max_wait_s: float = 30.0,
        chat_overhead_tokens: int = DEFAULT_CHAT_OVERHEAD_TOKENS,
        transport: httpx.BaseTransport | None = None,
        recheck_s: float = 5.0,
    ):
        checks = (
            ("concurrency", concurrency >= 1, "must be >= 1"),
            ("timeout_s", timeout_s > 0, "must be > 0 seconds"),
            ("max_retries", max_retries >= 0, "must be >= 0"),
            ("context_tokens", context_tokens is None or context_tokens > 0, "must be a positive token count"),
            ("retry_wait_s", retry_wait_s >= 0 and retry_max_wait_s >= 0, "and retry_max_wait_s must be >= 0"),
        )
        for knob, ok, why in checks:
            if not ok:
                raise ConfigError(f"OpenAIBackend: {knob} {why}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ConfigError("OpenAIBackend: give at least one base_url")
        for url in urls:
            check_base_url(url)
        self.base_urls = tuple(dict.fromkeys(u.rstrip("/") for u in urls))
        self.base_url = self.base_urls[0]
        self.model = model
        self.name = f"openai:{model}"
        self.api_key_env = api_key_env
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.context_tokens = check_context_tokens(context_tokens, "openai")
        self.tokenizer = tokenizer
        self.extra_body = dict(extra_body or {})
        self.chat_overhead_tokens = chat_overhead_tokens
        self._key = _api_key(api_key_env)
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s),
                                    transport=transport if transport is not None else KeepAliveTransport())
        self._backoff = tenacity.wait_exponential(multiplier=retry_wait_s, max=retry_max_wait_s) + tenacity.wait_random(
            0, retry_wait_s
        )
        self.retry_max_wait_s = retry_max_wait_s
        self._warned_control_text = False
        self.pool = EndpointPool(self.base_urls, self._probe, recheck_s, on_leave=self._warn_left)

    def __repr__(self) -> str:
        urls = self.base_url if len(self.base_urls) == 1 else list(self.base_urls)
        return f"OpenAIBackend(base_url={urls!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        """Estimated prompt tokens: the contents' tokens plus ``chat_overhead_tokens`` for the template.

        Returns ``None`` when no tokenizer was given (the server's template cannot be rendered here).
        """
        if self.tokenizer is None:
            return None
        return sum(len(self.tokenizer.encode(m.content)) for m in messages) + self.chat_overhead_tokens

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Send the requests, at most ``concurrency`` at a time, and return completions in request order.

        A request that fails (after retries where retrying makes sense) comes back with
        ``finish_reason="error"`` and an ``error`` naming its request id.

        Raises:
            ConfigError: a request no backend can serve (:func:`memagent.backends.base.check_request`), before
                any is sent.
        """
        if not requests:
            return []
        for r in requests:  # refused before any request is sent: a bad request, or a setting servers cannot take
            check_request(r)
            engine_options(r, "openai")
        if not self._warned_control_text:
            for r in requests:
                hit = next((m for msg in r.messages if (m := _CONTROL_LIKE.search(msg.content))), None)
                if hit:
                    self._warned_control_text = True
                    warnings.warn(
                        f"request {r.request_id} contains {hit.group(0)!r}: the server tokenizes prompts itself, and "
                        "many servers turn such strings into control tokens. In-process backends (llamacpp, hf) keep "
                        "them as plain text.", stacklevel=2)
                    break
        if len(requests) == 1:
            return [self._complete(requests[0])]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(self._complete, requests))

    def _complete(self, request: Request) -> Completion:
        """One request, retried (on another endpoint at once when its endpoint is gone).

        Raises:
            EndpointsDown: no endpoint answers any more (after the retries).
        """
        start = time.perf_counter()
        attempts = failovers = 0
        failed_on = None

        def attempt() -> Completion:
            nonlocal attempts, failovers, failed_on
            attempts += 1
            try:
                return self._post(request, avoid=failed_on)
            except _Transient as e:
                failovers += e.failover
                failed_on = e.endpoint
                raise

        def stop(state: tenacity.RetryCallState) -> bool:  # a failover does not use up a retry
            spent = attempts - min(failovers, 2 * len(self.base_urls))
            return spent >= self.max_retries + 1

        retrying = tenacity.Retrying(stop=stop, wait=self._wait, retry=tenacity.retry_if_exception_type(_Transient),
                                     reraise=True)
        try:
            completion = retrying(attempt)
        except (_Transient, BackendError) as e:
            err = e.error if isinstance(e, _Transient) else e
            # the run stops only when no server answers its health check either: a server that dropped this one
            # request (closed the connection mid-answer) but answers GET /models is there, and the request is one
            # failed sample (an error row), not a reason to stop every sample at the same place on each rerun
            if isinstance(err, EndpointsDown) or (isinstance(e, _Transient) and not self.pool.any_up()
                                                  and not self.pool.recheck()):
                raise EndpointsDown(self._redact(self.pool.down_message()), request.request_id) from None
            note = f" (after {attempts} attempts)" if attempts > 1 else ""
            error = self._redact(f"{type(err).__name__}: {err}{note}")
            return Completion("", "error", seconds=time.perf_counter() - start, error=error)
        return _with_seconds(completion, time.perf_counter() - start)

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """Exponential backoff with jitter, stretched to the server's Retry-After (capped at retry_max_wait_s);
        none before a failover to another endpoint."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, _Transient) and exc.failover:
            return 0.0
        wait = self._backoff(state)
        if isinstance(exc, _Transient) and exc.retry_after_s is not None:
            wait = max(wait, min(exc.retry_after_s, self.retry_max_wait_s))
        return wait

    def _post(self, request: Request, avoid=None) -> Completion:
        """One HTTP attempt on the endpoint the pool picks (not ``avoid``, where the last attempt failed, while
        another is up); raises _Transient for retryable failures (marking an endpoint whose connection failed
        down; an answer with a retryable status counts as a failed attempt of its endpoint), BackendError for
        final ones."""
        rid = request.request_id
        try:
            ep = self.pool.acquire(request.affinity, avoid=avoid)
        except EndpointsDown as e:
            raise _Transient(e) from None
        answered = False
        try:
            resp = self._client.post(f"{ep.url}/chat/completions", json=build_payload(request, self.model, self.extra_body))
            answered = resp.status_code not in RETRY_STATUSES
        except httpx.TimeoutException as e:
            if isinstance(e, httpx.ConnectTimeout):
                others = self.pool.mark_down(ep, f"{type(e).__name__}")
                raise _Transient(BackendTimeout(f"cannot connect to {ep.url} in time", rid), failover=others) from e
            # took the request and answers nothing, not even its health check: it leaves the rotation (with one
            # server too, so a hung server stops the run as a dead one does, instead of failing every sample)
            hung = not self._answers(ep.url)
            others = hung and self.pool.mark_down(ep, f"{type(e).__name__}, and its health check got no answer")
            raise _Transient(BackendTimeout(f"no answer from {ep.url} in time ({type(e).__name__})", rid),
                             failover=others, endpoint=ep) from e
        except httpx.TransportError as e:
            others = self.pool.mark_down(ep, f"{type(e).__name__}: {e}") if isinstance(e, _GONE) else self.pool.any_up()
            raise _Transient(BackendError(f"cannot reach {ep.url}: {type(e).__name__}: {e}", rid),
                             failover=others and isinstance(e, _GONE), endpoint=ep) from e
        finally:
            self.pool.release(ep, answered)
        return self._read(resp, request, ep)

    def _read(self, resp: httpx.Response, request: Request, ep=None) -> Completion:
        rid = request.request_id
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        if resp.status_code >= 400 or resp.status_code < 200:
            err = error_from_http(resp.status_code, body, rid, url=None if ep is None else ep.url)
            if resp.status_code in RETRY_STATUSES:
                raise _Transient(err, _retry_after_s(resp.headers.get("retry-after")), endpoint=ep)
            raise err
        if isinstance(body, str):
            raise BadResponse(f"HTTP {resp.status_code} with a body that is not JSON: {body[:200]!r}", rid)
        completion = parse_response(body, rid)
        if self.tokenizer is None:
            return completion
        sent = request.content_tokens
        if sent is None:
            sent = sum(len(self.tokenizer.encode(m.content)) for m in request.messages)
        if completion.usage == Usage():  # the server reported no usage: the client's estimate in its place
            estimate = Usage(sent + self.chat_overhead_tokens, len(self.tokenizer.encode(completion.text)))
            return dataclasses.replace(completion, usage=estimate)
        check_prompt_usage(completion.usage.prompt_tokens, sent, rid)
        return completion

    def _warn_left(self, ep, why: str) -> None:
        warnings.warn(self._redact(f"server {ep.url} left the rotation ({why}); its requests go to the other servers, "
                                   f"and it is probed again every {self.pool.recheck_s:g} s"), stacklevel=2)

    def _answers(self, url: str) -> bool:
        """Whether the server at ``url`` answers its health check now (after a request to it timed out: a slow
        request on a live server, or a hung server that accepts connections and answers nothing)."""
        try:
            self._probe(url)
        except httpx.HTTPError:
            return False
        return True

    def _probe(self, url: str, timeout_s: float = 2.0) -> httpx.Response:
        """A health check: ``GET /models`` (any HTTP answer means the server is there)."""
        return self._client.get(f"{url}/models", timeout=timeout_s)

    def check_reachable(self, timeout_s: float | None = None, check_model: bool = True) -> None:
        """Fail fast, before any sample, when no server can be reached, one refuses the key, the base URL is not
        the API root, or the model is not served: one ``GET /models`` per endpoint, without retries. A server
        that lists models must list ``model`` (``check_model``; the trainer's servers get their adapters' names
        later); one that does not list them (another HTTP status) passes. With several endpoints, one that
        cannot be reached is warned about and left out of the rotation (it is probed again later).

        Args:
            timeout_s: seconds to wait for each server (default: the backend's ``timeout_s``, at most 10).
            check_model: refuse a model the servers' listing lacks.

        Raises:
            BackendError: no endpoint can be reached (names each ``base_url``); HTTP 401/403 (names the key's
                environment variable); a redirect (names where to, e.g. ``https://``); a 404 where the URL with
                ``/v1`` added answers (names that URL); a listing without ``model`` (names the served ones).
        """
        timeout_s = timeout_s if timeout_s is not None else min(10.0, self._client.timeout.read or 10.0)
        failures = []
        for ep in self.pool.endpoints:
            try:
                resp = self._probe(ep.url, timeout_s)
            except httpx.HTTPError as e:
                hint = " (an https:// URL for an http server?)" if ep.url.startswith("https://") else ""
                failures.append((ep, f"{type(e).__name__}: {e}{hint}"))
                continue
            self._check_listing(ep.url, resp, check_model)
        if len(failures) == len(self.base_urls):
            where = "; ".join(f"{ep.url} ({why})" for ep, why in failures)
            raise BackendError(self._redact(f"cannot reach {where}; is the server running, and is --base-url right "
                                            "(with its /v1 prefix)?"))
        for ep, why in failures:
            self.pool.mark_down(ep, why, quiet=True)
            warnings.warn(self._redact(f"cannot reach {ep.url} ({why}): left out of the rotation for now (probed "
                                       f"again every {self.pool.recheck_s:g} s)"), stacklevel=2)

    def _check_listing(self, url: str, resp: httpx.Response, check_model: bool) -> None:
        """The checks of :meth:`check_reachable` on one server's ``GET /models`` answer."""
        status = resp.status_code
        if status in (401, 403):
            raise BackendError(f"{url} refused the API key (HTTP {status}); put the key in ${self.api_key_env} "
                               "(--api-key-env names the variable)")
        if 300 <= status < 400:
            to = resp.headers.get("location", "?")
            raise BackendError(self._redact(f"{url}/models redirects (HTTP {status}) to {to}: give --base-url as the "
                                            "server's own API root (e.g. https:// where it redirects there)"))
        if status == 404 and not url.endswith("/v1"):
            try:
                with_v1 = self._probe(f"{url}/v1").status_code == 200
            except httpx.HTTPError:
                with_v1 = False
            if with_v1:
                raise BackendError(self._redact(f"{url}/models is not found, but {url}/v1/models answers: give "
                                                f"--base-url {url}/v1 (the API root, with its /v1 prefix)"))
        if status != 200 or not check_model:
            return
        try:
            entries = {e.get("id"): e for e in resp.json().get("data") or [] if isinstance(e, dict)}
        except (ValueError, AttributeError):
            return
        if entries and self.model not in entries:
            listed = list(entries)
            shown = ", ".join(map(repr, listed[:8])) + (" ..." if len(listed) > 8 else "")
            raise BackendError(self._redact(f"{url} does not serve model {self.model!r} (it lists {shown}); give "
                                            "--model as the server names it (vLLM: --served-model-name)"))
        window = entries.get(self.model, {}).get("max_model_len")
        if isinstance(window, int) and window > 0 and self.context_tokens is not None and self.context_tokens > window:
            raise BackendError(f"{url} serves {self.model!r} with a window of {window} tokens (max_model_len), "
                               f"smaller than the {self.context_tokens} assumed (--n-ctx): every budget was checked "
                               f"against the wrong window; give --n-ctx {window} (or less)")

    def server_context_tokens(self) -> int | None:
        """The served model's context window as the server reports it (vLLM's ``max_model_len`` in
        ``GET /models``, from the first endpoint), or ``None`` when the server does not say (llama.cpp's server,
        hosted APIs).

        Raises:
            BackendError: the server cannot be reached or answers with an error.
        """
        try:
            resp = self._client.get(f"{self.base_url}/models")
        except httpx.HTTPError as e:
            raise BackendError(self._redact(f"cannot reach {self.base_url}/models: {type(e).__name__}: {e}")) from e
        if resp.status_code != 200:
            raise BackendError(self._redact(f"GET {self.base_url}/models: HTTP {resp.status_code}: {resp.text[:200]}"))
        try:
            entries = resp.json().get("data") or []
        except (ValueError, AttributeError):
            return None
        for entry in entries:
            if isinstance(entry, dict) and entry.get("id") == self.model:
                value = entry.get("max_model_len")
                return value if isinstance(value, int) and value > 0 else None
        return None

    def endpoint_stats(self) -> dict[str, dict[str, int | bool]]:
        """Per endpoint (by URL): answered requests, failed attempts, whether it is in the rotation."""
        return self.pool.stats()

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "***") if self._key else text

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_seconds(c: Completion, seconds: float) -> Completion:
    return dataclasses.replace(c, seconds=seconds)
