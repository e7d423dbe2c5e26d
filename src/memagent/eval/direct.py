"""The long-context baseline: the whole document in one prompt (:data:`DIRECT_TEMPLATE`).

The document is center-truncated so the prompt fits ``max_input_tokens`` (default: the window minus the answer
cap); the reference instead truncates the whole rendered prompt, which can cut into the question (reference
doc section 1.7).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from memagent.errors import ConfigError
from memagent.runfiles.rows import NOT_RUN
from memagent.types import Message, Request, Sample

#: The direct baseline's prompt (memagent's wording; slots {document}, {question}).
DIRECT_TEMPLATE = (
    "Read the document below and answer the question that follows it.\n\n<document>\n{document}\n</document>\n\n"
    "Question: {question}\n\nAnswer briefly and put the final answer in \\boxed{{}}."
)


def direct_template_hash() -> str:
    """12 hex digits of the SHA-256 of :data:`DIRECT_TEMPLATE` (recorded as the direct method's prompt hash)."""
    import hashlib

    return hashlib.sha256(DIRECT_TEMPLATE.encode()).hexdigest()[:12]


class DirectMethod:
    """One ``direct`` method of a grid on one backend.

    Args:
        method: the method's config (:class:`memagent.eval.grid.MethodConfig`).
        agent: its agent settings with the grid's sampling (temperature, top-p, seed, extra sampling settings).
        backend: the backend it runs on.
        tokenizer: the model's tokenizer.
    """

    def __init__(self, method, agent, backend, tokenizer):
        self.method, self.agent, self.backend, self.tokenizer = method, agent, backend, tokenizer

    def cap(self) -> int | None:
        """The prompt's cap in tokens: ``max_input_tokens``, else the window minus the answer cap."""
        if self.method.max_input_tokens is not None:
            return self.method.max_input_tokens
        window = self.backend.context_tokens
        return None if window is None else window - self.method.max_new_tokens

    def fixed_tokens(self, question: str) -> int:
        """Tokens of the direct prompt with ``question`` and no document (chat template included)."""
        return self._prompt_tokens(DIRECT_TEMPLATE.format(document="", question=question))

    def check(self) -> None:
        """Refuse, before any row, caps that cannot fit the backend's window whatever the sample.

        Raises:
            ConfigError: naming the method, the sum that does not fit and the setting to change.
        """
        m, window = self.method, self.backend.context_tokens
        if m.max_input_tokens is not None:
            if m.max_input_tokens < 1:
                raise ConfigError(f"method {m.name!r}: max_input_tokens must be >= 1, got {m.max_input_tokens}")
            if window is not None and m.max_input_tokens + m.max_new_tokens > window:
                raise ConfigError(
                    f"method {m.name!r}: max_input_tokens {m.max_input_tokens} + max_new_tokens {m.max_new_tokens} "
                    f"exceeds the context window of {self.backend.name} ({window} tokens); lower one of them")
        elif window is not None and window - m.max_new_tokens < 1:
            raise ConfigError(f"method {m.name!r}: max_new_tokens {m.max_new_tokens} leaves no room for a prompt in "
                              f"the context window of {self.backend.name} ({window} tokens)")
        cap = self.cap()
        fixed = self.fixed_tokens("")
        if cap is not None and cap - fixed - 2 < 2:
            raise ConfigError(f"method {m.name!r}: the direct prompt takes {fixed} tokens without any document or "
                              f"question, and a truncated document needs 4 more: {fixed + 4} tokens, over the prompt "
                              f"cap of {cap} tokens; raise max_input_tokens")

    def prompt(self, s: Sample, budget: int) -> tuple[str, int, tuple[tuple[int, int], ...]]:
        """``(prompt text, document tokens kept, character ranges of the context kept)`` for one sample.

        Raises:
            ConfigError: the question alone leaves no room for any document.
        """
        from memagent.chunking import kept_ranges
        from memagent.tokenization import token_boundaries

        fixed = self.fixed_tokens(s.question)
        bounds = token_boundaries(self.tokenizer, s.context)
        n = len(bounds) - 1
        if fixed + n <= budget:  # the whole document may fit: count the whole prompt to be sure
            text = DIRECT_TEMPLATE.format(document=s.context, question=s.question)
            if self._prompt_tokens(text) <= budget:
                return text, n, ((0, len(s.context)),)
        if budget - fixed - 2 < 2:  # center truncation keeps at least one head and one tail token
            raise ConfigError(f"sample {s.id}: the direct prompt takes {fixed} tokens without any document, and a "
                              f"truncated document needs 4 more (a head and a tail token, and 2 where the cut text "
                              f"joins the template may tokenize differently): {fixed + 4} tokens, over the prompt cap "
                              f"of {budget} tokens; raise max_input_tokens or shorten the question")
        ranges, kept = kept_ranges(bounds, len(s.context), budget - fixed - 2)
        doc = "".join(s.context[a:b] for a, b in ranges)
        return DIRECT_TEMPLATE.format(document=doc, question=s.question), kept, ranges

    def _prompt_tokens(self, text: str) -> int:
        """Tokens of the direct prompt ``text`` as the backend counts it (chat template included)."""
        from memagent.backends.base import DEFAULT_CHAT_OVERHEAD_TOKENS
        from memagent.tokenization import count_tokens

        n = self.backend.count_prompt_tokens((Message("user", text),))
        return n if n is not None else count_tokens(self.tokenizer, text) + DEFAULT_CHAT_OVERHEAD_TOKENS

    def seed(self, sample_id: str) -> int:
        return zlib.crc32(f"{self.agent.seed}/{sample_id}/direct".encode()) & 0x7FFFFFFF

    def run(self, samples: Sequence[Sample], write: Callable[[Sample, Any], None]) -> None:
        """Answer ``samples`` in batches of ``batch_size``; ``write(sample, outcome)`` gets every sample's outcome
        (:class:`memagent.runfiles.Outcome`; a question too long for the cap is an error outcome, not a crash).

        Raises:
            ConfigError: the cap is unknown (no ``max_input_tokens`` and no known window).
        """
        from memagent.answers import extract_answer
        from memagent.runfiles import Outcome

        m, a = self.method, self.agent
        budget = self.cap()
        if budget is None:
            raise ConfigError(f"method {m.name!r}: set max_input_tokens (the backend's context window is unknown)")
        sampling = a.sampling_options()
        for i in range(0, len(samples), a.batch_size):
            prepared: list[tuple[Sample, str, int, tuple]] = []  # (sample, prompt, document tokens, ranges kept)
            for s in samples[i : i + a.batch_size]:
                try:
                    prepared.append((s, *self.prompt(s, budget)))
                except ConfigError as e:
                    write(s, Outcome(error=f"{NOT_RUN}{e}"))
            if not prepared:
                continue
            requests = [Request((Message("user", text),), m.max_new_tokens, a.temperature, a.top_p, self.seed(s.id),
                                f"{s.id}/direct", dict(sampling)) for s, text, _, _ in prepared]
            t0 = time.perf_counter()
            comps = self.backend.generate(requests)
            share = (time.perf_counter() - t0) / len(prepared)
            for (s, _, doc_tokens, ranges), c in zip(prepared, comps):
                usage = dict(prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens, turns=1,
                             document_tokens=doc_tokens, seconds=c.seconds or share, document_chars=ranges)
                if c.finish_reason == "error":
                    write(s, Outcome(error=c.error or "backend error", **usage))
                else:
                    ext = extract_answer(c.text)
                    write(s, Outcome(c.text, ext.answer, ext.method, **usage))
