"""Any OpenAI-compatible chat-completions server (vLLM, llama.cpp's server, SGLang, hosted APIs).

Split as in lm-evaluation-harness: :func:`build_payload` and :func:`parse_response` (plus
:func:`error_from_http`) are pure functions tested on hand-built JSON; :class:`OpenAIBackend` is the
transport: a sync ``httpx.Client`` shared by a thread pool of ``concurrency`` workers, with tenacity retries
(exponential backoff with jitter) on 429, 408, 5xx, connection errors and timeouts. Other 4xx answers are
not retried. A request that still fails comes back as an error completion naming its request id; the rest
of the batch goes on. With a tokenizer, an answer whose ``usage.prompt_tokens`` shows that the server cut the
prompt to its window is such an error too (:func:`check_prompt_usage`).

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
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import tenacity

from memagent.backends.base import DEFAULT_CHAT_OVERHEAD_TOKENS, check_context_tokens, check_request
from memagent.backends.chat import messages_as_dicts
from memagent.errors import BackendError, BackendTimeout, BadResponse, ConfigError, ContextOverflow, PromptTruncated
from memagent.tokenization import Tokenizer
from memagent.types import Completion, FinishReason, Message, Request, Usage

#: HTTP statuses worth retrying: rate limiting, request timeout, server-side failures.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

_FINISH_REASONS: dict[str | None, FinishReason] = {
    "stop": "stop",
    "eos": "stop",
    "end_turn": "stop",
    "stop_sequence": "stop",
    None: "stop",  # some servers omit it on a normal end
    "length": "length",
    "max_tokens": "length",
}

# Wordings of "prompt too long" in vLLM, llama.cpp's server, SGLang and the OpenAI API.
_OVERFLOW = re.compile(
    r"context_length_exceeded|maximum context length|context window|context length|exceeds? the max"
    r"|too many tokens|prompt is too long|input is too long|max_model_len",
    re.IGNORECASE,
)


#: How far a server's ``usage.prompt_tokens`` may fall below the client's own count of the message contents
#: before the prompt counts as cut by the server: a fixed number of tokens (pieces merge differently at the
#: template's seams) plus a share of the count (a tokenizer close to, but not exactly, the served one).
PROMPT_USAGE_SLACK_TOKENS = 16
PROMPT_USAGE_SLACK_SHARE = 0.05


def check_prompt_usage(reported_tokens: int, content_tokens: int, request_id: str) -> None:
    """Refuse a completion made from a prompt the server cut short.

    The chat template only adds tokens to the message contents, so a server that counts far fewer prompt
    tokens than the contents hold (``reported_tokens < content_tokens - slack``, slack =
    ``PROMPT_USAGE_SLACK_TOKENS + PROMPT_USAGE_SLACK_SHARE * content_tokens``) has cut the prompt to its own
    window, as vLLM's ``truncate_prompt_tokens`` and some hosted APIs do, and its answer comes from text the
    agent never meant to send (a memory update from half a chunk, an answer without the question).

    Args:
        reported_tokens: the server's ``usage.prompt_tokens``; 0 (usage not reported) skips the check.
        content_tokens: tokens of the request's message contents by the client's tokenizer (no template).
        request_id: named in the error.

    Raises:
        PromptTruncated: naming both counts and the setting to change.
    """
    if reported_tokens <= 0:
        return
    slack = PROMPT_USAGE_SLACK_TOKENS + int(PROMPT_USAGE_SLACK_SHARE * content_tokens)
    if reported_tokens < content_tokens - slack:
        raise PromptTruncated(
            f"the server counted {reported_tokens} prompt tokens, but the messages alone hold {content_tokens} "
            "tokens (by --tokenizer): the server cut the prompt to fit its context window. Set --n-ctx "
            "(context_tokens) to the server's real window so prompts are sized to fit it, or start the server with "
            "a larger one (vLLM --max-model-len, llama.cpp server --ctx-size); if --tokenizer is not the served "
            "model's own tokenizer, give that one", request_id)


# Strings that chat templates use as control tokens (ChatML, Llama, Mistral, GPT-2 style end of text).
_CONTROL_LIKE = re.compile(r"<\|[A-Za-z_][A-Za-z0-9_]{0,30}\|>|</?s>|\[/?INST\]")


def build_payload(request: Request, model: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /chat/completions`` for one request.

    Args:
        request: the chat request.
        model: the server's model name.
        extra: extra body fields (e.g. vLLM's ``{"top_k": -1}``); added last, so they override ours.

    Returns:
        A JSON-serialisable dict with ``model``, ``messages``, ``max_tokens``, ``temperature``, ``top_p``,
        ``stream=False`` and ``seed`` when the request has one.
    """
    payload: dict[str, Any] = {
        "model": model,
        "messages": messages_as_dicts(request.messages),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": False,
    }
    if request.seed is not None:
        payload["seed"] = request.seed
    if extra:
        payload.update(extra)
    return payload


def parse_response(data: Any, request_id: str) -> Completion:
    """Turn a chat-completions JSON answer into a :class:`Completion`.

    Reads ``choices[0].message.content`` (``null`` counts as ""), ``choices[0].finish_reason``, ``usage``,
    and, when the server returns them (vLLM with ``return_token_ids``), ``choices[0].token_ids`` and
    ``prompt_token_ids`` (top level or in the choice).

    Args:
        data: the decoded JSON body.
        request_id: named in errors.

    Raises:
        ContextOverflow: the body is an error object about the context window.
        BackendError: the body is some other error object.
        BadResponse: the body is not a valid chat completion (missing choices/message, wrong types, an
            unknown finish_reason).
    """
    if not isinstance(data, dict):
        raise BadResponse(f"expected a JSON object, got {type(data).__name__}", request_id)
    if "error" in data:
        raise _classify(400, _error_message(data), request_id, overflow_any_status=True)
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadResponse(f"no choices in the response (keys: {sorted(data)})", request_id)
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise BadResponse("choices[0] has no message object", request_id)
    content = message.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadResponse(f"choices[0].message.content is {type(content).__name__}, not a string", request_id)
    reason = choice.get("finish_reason")
    if reason not in _FINISH_REASONS:
        raise BadResponse(f"unknown finish_reason {reason!r}", request_id)
    usage = data.get("usage") or {}
    if not isinstance(usage, dict):
        raise BadResponse("usage is not an object", request_id)
    token_ids = _int_tuple(choice.get("token_ids"), "choices[0].token_ids", request_id)
    prompt_ids = _int_tuple(
        data.get("prompt_token_ids", choice.get("prompt_token_ids")), "prompt_token_ids", request_id
    )
    return Completion(
        text=content,
        finish_reason=_FINISH_REASONS[reason],
        usage=Usage(
            prompt_tokens=_count(usage, "prompt_tokens", request_id),
            completion_tokens=_count(usage, "completion_tokens", request_id),
        ),
        token_ids=token_ids,
        prompt_token_ids=prompt_ids,
    )


def error_from_http(status: int, body: Any, request_id: str) -> BackendError:
    """The error for a non-2xx answer.

    Args:
        status: HTTP status code.
        body: the decoded JSON body, or the raw text when it is not JSON.
        request_id: named in the error.

    Returns:
        :class:`ContextOverflow` for a 400/413/422 about the context window, :class:`BackendTimeout` for 408
        and 504, else :class:`BackendError` with the status and the server's message (cut to 500 chars).
    """
    return _classify(status, _error_message(body), request_id)


def _classify(status: int, message: str, request_id: str, overflow_any_status: bool = False) -> BackendError:
    text = f"HTTP {status}: {message[:500]}" if not overflow_any_status else message[:500]
    if (overflow_any_status or status in (400, 413, 422)) and _OVERFLOW.search(message):
        return ContextOverflow(f"the server refused the prompt as too long ({text})", request_id)
    if status in (408, 504):
        return BackendTimeout(text, request_id)
    if status == 404:
        text += " (check that the base URL ends with the API prefix, e.g. http://host:port/v1, and that the model name is served)"
    return BackendError(text, request_id)


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            parts = [str(err.get(k)) for k in ("message", "code", "type") if err.get(k)]
            return "; ".join(parts) or str(err)
        if err is not None:
            return str(err)
    return str(body)


def _int_tuple(value: Any, field: str, request_id: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadResponse(f"{field} is not a list of integers", request_id)
    return tuple(value)


def _count(usage: dict, key: str, request_id: str) -> int:
    value = usage.get(key, 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadResponse(f"usage.{key} is {value!r}, not a non-negative integer", request_id)
    return value


class _Transient(Exception):
    """Carries a retryable BackendError through tenacity (and the server's Retry-After, in seconds)."""

    def __init__(self, error: BackendError, retry_after_s: float | None = None):
        super().__init__(str(error))
        self.error = error
        self.retry_after_s = retry_after_s


def _retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header given as a number (the HTTP-date form is ignored)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class OpenAIBackend:
    """A model behind an OpenAI-compatible ``/chat/completions`` endpoint.

    Args:
        base_url: the API root including its version prefix, e.g. ``http://127.0.0.1:8000/v1``.
        model: model name sent in every request.
        api_key_env: environment variable holding the API key; unset or empty sends no key.
        concurrency: requests in flight at once (threads sharing one connection pool).
        timeout_s: per-attempt timeout in seconds (connect, read, write and pool).
        max_retries: retries after the first attempt for 429/408/5xx, connection errors and timeouts.
        context_tokens: the model's context window in tokens, when known (chat servers do not report it with
            completions; :meth:`server_context_tokens` asks vLLM for it).
        tokenizer: a tokenizer matching the served model, used by :meth:`count_prompt_tokens` and to check the
            server's ``usage.prompt_tokens`` (:func:`check_prompt_usage`: a prompt the server cut short
            comes back as a :class:`PromptTruncated` error completion).
        extra_body: extra fields added to every payload (see :func:`build_payload`).
        retry_wait_s: first backoff wait in seconds; it doubles per retry, plus up to ``retry_wait_s`` of
            random jitter.
        retry_max_wait_s: cap on one backoff wait, in seconds.
        chat_overhead_tokens: tokens added for chat-template wrapping by :meth:`count_prompt_tokens`.
        transport: an ``httpx`` transport (tests pass ``httpx.MockTransport``).

    Attributes:
        name: ``"openai:<model>"``.
        batched: False: requests run concurrently, one HTTP call each.

    Raises:
        ConfigError: a setting is out of range.
    """

    batched = False

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout_s: float = 600,
        max_retries: int = 4,
        context_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
        extra_body: dict[str, Any] | None = None,
        retry_wait_s: float = 1.0,
        retry_max_wait_s: float = 30.0,
        chat_overhead_tokens: int = DEFAULT_CHAT_OVERHEAD_TOKENS,
        transport: httpx.BaseTransport | None = None,
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
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"OpenAIBackend: base_url {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"openai:{model}"
        self.api_key_env = api_key_env
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.context_tokens = check_context_tokens(context_tokens, "openai")
        self.tokenizer = tokenizer
        self.extra_body = dict(extra_body or {})
        self.chat_overhead_tokens = chat_overhead_tokens
        self._key = os.environ.get(api_key_env) or None
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        self._client = httpx.Client(
            base_url=self.base_url + "/",
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            transport=transport,
        )
        self._backoff = tenacity.wait_exponential(multiplier=retry_wait_s, max=retry_max_wait_s) + tenacity.wait_random(
            0, retry_wait_s
        )
        self.retry_max_wait_s = retry_max_wait_s
        self._warned_control_text = False

    def __repr__(self) -> str:
        return f"OpenAIBackend(base_url={self.base_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"

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
        for r in requests:
            check_request(r)
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
        start = time.perf_counter()
        attempts = 0

        def attempt() -> Completion:
            nonlocal attempts
            attempts += 1
            return self._post(request)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=tenacity.retry_if_exception_type(_Transient),
            reraise=True,
        )
        try:
            completion = retrying(attempt)
        except (_Transient, BackendError) as e:
            err = e.error if isinstance(e, _Transient) else e
            note = f" (after {attempts} attempts)" if attempts > 1 else ""
            error = self._redact(f"{type(err).__name__}: {err}{note}")
            return Completion("", "error", seconds=time.perf_counter() - start, error=error)
        return _with_seconds(completion, time.perf_counter() - start)

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """Exponential backoff with jitter, stretched to the server's Retry-After (capped at retry_max_wait_s)."""
        wait = self._backoff(state)
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, _Transient) and exc.retry_after_s is not None:
            wait = max(wait, min(exc.retry_after_s, self.retry_max_wait_s))
        return wait

    def _post(self, request: Request) -> Completion:
        """One HTTP attempt; raises _Transient for retryable failures, BackendError for final ones."""
        rid = request.request_id
        try:
            resp = self._client.post("chat/completions", json=build_payload(request, self.model, self.extra_body))
        except httpx.TimeoutException as e:
            raise _Transient(BackendTimeout(f"no answer from {self.base_url} in time ({type(e).__name__})", rid)) from e
        except httpx.TransportError as e:
            raise _Transient(BackendError(f"cannot reach {self.base_url}: {type(e).__name__}: {e}", rid)) from e
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        if resp.status_code >= 400 or resp.status_code < 200:
            err = error_from_http(resp.status_code, body, rid)
            if resp.status_code in RETRY_STATUSES:
                raise _Transient(err, _retry_after_s(resp.headers.get("retry-after")))
            raise err
        if isinstance(body, str):
            raise BadResponse(f"HTTP {resp.status_code} with a body that is not JSON: {body[:200]!r}", rid)
        completion = parse_response(body, rid)
        if self.tokenizer is not None:
            sent = sum(len(self.tokenizer.encode(m.content)) for m in request.messages)
            check_prompt_usage(completion.usage.prompt_tokens, sent, rid)
        return completion

    def check_reachable(self, timeout_s: float = 10.0) -> None:
        """Fail fast, before any sample, when the server cannot be reached or refuses the key: one ``GET
        /models`` without retries. Other HTTP statuses pass (not every compatible server lists its models).

        Raises:
            BackendError: a connection error or timeout (names ``base_url``), or HTTP 401/403 (names the key's
                environment variable).
        """
        try:
            resp = self._client.get("models", timeout=timeout_s)
        except httpx.HTTPError as e:
            raise BackendError(self._redact(f"cannot reach {self.base_url} ({type(e).__name__}: {e}); is the server "
                                            "running, and is --base-url right (with its /v1 prefix)?")) from e
        if resp.status_code in (401, 403):
            raise BackendError(f"{self.base_url} refused the API key (HTTP {resp.status_code}); put the key in "
                               f"${self.api_key_env} (--api-key-env names the variable)")

    def server_context_tokens(self) -> int | None:
        """The served model's context window as the server reports it (vLLM's ``max_model_len`` in
        ``GET /models``), or ``None`` when the server does not say (llama.cpp's server, hosted APIs).

        Raises:
            BackendError: the server cannot be reached or answers with an error.
        """
        try:
            resp = self._client.get("models")
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
