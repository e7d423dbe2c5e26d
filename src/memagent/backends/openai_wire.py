"""The wire format of OpenAI-compatible chat completions: pure functions, tested on hand-built JSON.

:func:`build_payload` makes the body of ``POST /chat/completions``, :func:`parse_response` reads the answer,
:func:`error_from_http` classifies a failed one, and :func:`check_prompt_usage` refuses an answer made from a
prompt the server cut short. The transport (:class:`memagent.backends.openai_compat.OpenAIBackend`) calls
them; it re-exports them under their old names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from memagent.backends.chat import messages_as_dicts
from memagent.backends.sampling import engine_options
from memagent.errors import BackendError, BackendTimeout, BadResponse, ContextOverflow, PromptTruncated
from memagent.types import Completion, FinishReason, Request, Usage

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


def build_payload(request: Request, model: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /chat/completions`` for one request.

    Args:
        request: the chat request.
        model: the server's model name.
        extra: extra body fields (e.g. vLLM's ``{"top_k": -1}``); added last, so they override ours.

    Returns:
        A JSON-serialisable dict with ``model``, ``messages``, ``max_tokens``, ``temperature``, ``top_p``,
        ``stream=False``, ``seed`` when the request has one, and the request's extra sampling settings as the
        body fields vLLM, SGLang and llama.cpp's server take (:mod:`memagent.backends.sampling`).

    Raises:
        ConfigError: an extra sampling setting the servers cannot take.
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
    payload.update(engine_options(request, "openai"))
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


def error_from_http(status: int, body: Any, request_id: str, url: str | None = None) -> BackendError:
    """The error for a non-2xx answer.

    Args:
        status: HTTP status code.
        body: the decoded JSON body, or the raw text when it is not JSON.
        request_id: named in the error.
        url: the server that answered (named in the error, so that a failing replica among several is found).

    Returns:
        :class:`ContextOverflow` for a 400/413/422 about the context window, :class:`BackendTimeout` for 408
        and 504, else :class:`BackendError` with the status and the server's message (cut to 500 chars).
    """
    return _classify(status, _error_message(body), request_id, url=url)


def _classify(status: int, message: str, request_id: str, overflow_any_status: bool = False,
              url: str | None = None) -> BackendError:
    where = f" from {url}" if url else ""
    text = f"HTTP {status}{where}: {message[:500]}" if not overflow_any_status else message[:500]
    if (overflow_any_status or status in (400, 413, 422)) and _OVERFLOW.search(message):
        return ContextOverflow(f"the server refused the prompt as too long ({text}); the budgets assume a larger "
                               "window than it serves: give --n-ctx (backend n_ctx in a grid) as the server's window, "
                               "or lower --chunk-tokens/--memory-tokens", request_id)
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
