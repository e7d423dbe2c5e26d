"""The Backend protocol: a batch of chat requests in, one completion per request out.

The agent loop talks only to this protocol, so `memagent run`, evaluation and RL rollouts share one code
path whatever serves the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from memagent.configtypes import check_sampling
from memagent.tokenization import Tokenizer
from memagent.types import Completion, Message, Request

#: Tokens allowed for chat-template wrapping when a backend cannot count a rendered prompt itself
#: (role markers, default system prompt of small chat templates).
DEFAULT_CHAT_OVERHEAD_TOKENS = 64


def check_context_tokens(value: int | None, backend: str) -> int | None:
    """``value`` when it is ``None`` (unknown) or a positive window in tokens.

    Raises:
        ConfigError: a zero or negative window (naming the backend and the setting).
    """
    from memagent.errors import ConfigError

    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{backend} backend: the context window (context_tokens / --n-ctx) must be a positive "
                          f"number of tokens, got {value!r}")
    return value


def check_request(request: Request) -> None:
    """Refuse a request no backend can serve: ``max_tokens < 1``, or sampling settings outside
    :func:`memagent.configtypes.check_sampling` (a temperature or top-p that is NaN or infinite included).

    Every backend calls it on every request before any of them runs, so a request built by hand through the
    Python API fails as a whole batch, at once, instead of sampling noise or failing inside a JSON encoder.

    Raises:
        ConfigError: naming the request id and the setting.
    """
    from memagent.errors import ConfigError

    where = f"request {request.request_id!r}: "
    if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
        raise ConfigError(f"{where}max_tokens must be >= 1 (a whole number of tokens), got {request.max_tokens!r}")
    check_sampling(request.temperature, request.top_p, where=where)


@runtime_checkable
class Backend(Protocol):
    """A chat model.

    Attributes:
        name: backend name plus model, recorded with results.
        context_tokens: the model's context window (prompt + generated tokens) in tokens; ``None`` if unknown.
        tokenizer: the model's tokenizer when the backend has it (in-process backends), else ``None``.
        batched: True when one ``generate`` call runs its requests as one batch in process; False for
            servers, which run requests concurrently up to a bound.

    ``generate`` returns completions in request order. A request that fails (server error after retries,
    timeout, context overflow) yields a Completion with ``finish_reason="error"`` and ``error`` set, so one
    bad sample never sinks a batch; misconfiguration raises instead.
    """

    name: str
    context_tokens: int | None
    tokenizer: Tokenizer | None
    batched: bool

    def generate(self, requests: Sequence[Request]) -> list[Completion]: ...

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        """Exact prompt length in tokens after chat templating, or ``None`` if the backend cannot tell."""
        ...

    def close(self) -> None: ...
