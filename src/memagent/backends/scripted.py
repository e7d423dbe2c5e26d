"""A deterministic fake backend for tests and dry runs.

It answers with a user-supplied function of the request (or a fixed list of replies), records every
batch it was called with, and can be told to fail chosen requests: from Python with a predicate, or from an eval
grid's YAML with a regular expression on request ids (``backend: {name: scripted, fail: "^s1/"}``), so the
counting of failed samples can be dry-run without a model. ``fail`` is not part of a method's hash, so removing
it and rerunning with ``--retry-errors`` dry-runs the recovery too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from memagent.backends.base import check_context_tokens, check_request
from memagent.backends.sampling import engine_options
from memagent.errors import ConfigError
from memagent.tokenization import ByteTokenizer, Tokenizer
from memagent.types import Completion, Message, Request, Usage

_SECTION = re.compile(r"<section>\n(.*?)\n</section>", re.S)
_MEMORY = re.compile(r"<memory>\n(.*?)\n</memory>", re.S)


def default_responder(request: Request) -> str:
    """Update turns: keep the previous memory plus the section's first line (at most 80 chars).
    Final turns: box the memory's last line. Enough to watch the loop's mechanics without a model."""
    prompt = request.messages[-1].content
    memory = _MEMORY.search(prompt)
    section = _SECTION.search(prompt)
    mem = memory.group(1) if memory else ""
    if section is not None:
        first = section.group(1).strip().splitlines()[0][:80] if section.group(1).strip() else ""
        return (mem + "\n" + first).strip()
    last = mem.strip().splitlines()[-1] if mem.strip() else ""
    return "\\boxed{" + last + "}"


def _fail_predicate(fail: Callable[[Request], bool] | str | None) -> Callable[[Request], bool] | None:
    """``fail`` as a predicate: a string is a regular expression searched in the request id."""
    if fail is None or callable(fail):
        return fail
    if not isinstance(fail, str) or not fail:
        raise ConfigError(f"scripted backend: fail must be a regular expression on request ids (e.g. '^s1/'), got {fail!r}")
    try:
        pattern = re.compile(fail)
    except re.error as e:
        raise ConfigError(f"scripted backend: fail {fail!r} is not a regular expression ({e})") from None
    return lambda r: pattern.search(r.request_id) is not None


class ScriptedBackend:
    """Deterministic fake model.

    Args:
        responder: maps a request to its reply text; default :func:`default_responder`.
        replies: alternatively, a fixed list of reply texts handed out in call order (overrides responder).
        fail: which requests fail: a predicate on a request, or a regular expression searched in the request id
            (``<sample id>/<turn>``, e.g. ``"^s1/"``: every turn of sample s1; ``"final$"``: every final turn).
            Matching requests come back with ``finish_reason="error"``.
        context_tokens: context window to report (``None`` = unknown).
        tokenizer: used to count prompt/completion tokens, or a spec as ``--tokenizer`` takes it (``"bytes"``,
            ``"smollm2"``, a tokenizer.json); default :class:`ByteTokenizer`.
        batched: report itself as an in-process batched backend (True) or a server (False).

    Attributes:
        calls: every ``generate`` call's request list, in order.

    Raises:
        ConfigError: ``fail`` is neither a predicate nor a valid regular expression.
    """

    def __init__(
        self,
        responder: Callable[[Request], str] | None = None,
        replies: Sequence[str] | None = None,
        fail: Callable[[Request], bool] | str | None = None,
        context_tokens: int | None = None,
        tokenizer: Tokenizer | str | None = None,
        batched: bool = True,
    ):
        if isinstance(replies, str) or (replies is not None and not all(isinstance(r, str) for r in replies)):
            raise ConfigError(f"scripted backend: replies must be a list of reply texts, got {replies!r:.60} (one "
                              "reply: ['text'])")
        if not isinstance(batched, bool):
            raise ConfigError(f"scripted backend: batched must be true or false, got {batched!r}")
        self.responder = responder or default_responder
        self._replies = list(replies) if replies is not None else None
        self.fail = _fail_predicate(fail)
        self.context_tokens = check_context_tokens(context_tokens, "scripted")
        if isinstance(tokenizer, str):  # a spec, as --tokenizer takes it
            from memagent.tokenization import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        elif tokenizer is not None and not callable(getattr(tokenizer, "encode", None)):
            raise ConfigError(f"scripted backend: tokenizer must be a tokenizer or a spec such as 'bytes' or "
                              f"'smollm2', got {type(tokenizer).__name__} {tokenizer!r}")
        self.tokenizer = tokenizer or ByteTokenizer()
        self.batched = batched
        self.name = "scripted"
        self.calls: list[list[Request]] = []

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return sum(len(self.tokenizer.encode(m.content)) for m in messages)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """One reply per request, in order; a request no backend can serve raises ConfigError, as in the real
        backends (:func:`memagent.backends.base.check_request`)."""
        for r in requests:
            check_request(r)
        self.calls.append(list(requests))
        for r in requests:  # a fake model cannot honour extra sampling settings: refused, not silently ignored
            engine_options(r, "scripted")
        out = []
        for r in requests:
            if self.fail is not None and self.fail(r):
                out.append(Completion("", "error", error=f"scripted failure for {r.request_id}"))
                continue
            if self._replies is not None and not self._replies:
                raise ConfigError(f"scripted backend: its replies ran out at request {r.request_id} (each request "
                                  "takes the next reply; give one per request)")
            text = self._replies.pop(0) if self._replies is not None else self.responder(r)
            if not isinstance(text, str):
                raise TypeError(f"scripted backend: the reply to request {r.request_id} must be a string, got "
                                f"{type(text).__name__} {text!r}")
            ids = self.tokenizer.encode(text)
            finish = "stop"
            if len(ids) > r.max_tokens:
                ids = ids[: r.max_tokens]
                text = self.tokenizer.decode(ids)
                finish = "length"
            prompt_ids = [t for m in r.messages for t in self.tokenizer.encode(m.content)]
            out.append(
                Completion(
                    text=text,
                    finish_reason=finish,
                    usage=Usage(len(prompt_ids), len(ids)),
                    token_ids=tuple(ids),
                    prompt_token_ids=tuple(prompt_ids),
                )
            )
        return out

    def close(self) -> None:
        pass
