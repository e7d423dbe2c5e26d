"""Plain data handed from one stage of the pipeline to the next.

All types are frozen dataclasses (or simple mutable records where the agent loop fills them in) so each
stage can be tested with hand-built inputs. Lengths are in model tokens unless a name says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "error"]
TurnKind = Literal["update", "final"]


@dataclass(frozen=True)
class Sample:
    """One question over one long document.

    Attributes:
        id: unique id of the sample within its dataset.
        question: the question text (never truncated).
        context: the document text the agent reads chunk by chunk (a string, or a
            :class:`memagent.chunking.TextSource` read in pieces).
        answers: gold answers (empty when unknown, e.g. for `memagent run`); a list is stored as a tuple.

        metadata: free-form provenance (task, length in tokens, tokenizer name, ...).

    Raises:
        TypeError: ``id`` or ``question`` is not a string, ``context`` neither a string nor a TextSource, or ``answers`` is a bare string or holds
            non-strings.
    """

    id: str
    question: str
    context: str
    answers: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not isinstance(self.id, str):  # ids become request ids, row keys and file names
            raise TypeError(f"Sample id must be a string, got {type(self.id).__name__} {self.id!r}; write "
                            f"id={str(self.id)!r}")
        # found when built, not at the first chunking call deep in a run
        if not isinstance(self.question, str):
            raise TypeError(f"Sample {self.id!r}: question must be a string, got {type(self.question).__name__} "
                            f"{self.question!r:.60}")
        c = self.context
        if not isinstance(c, str) and not (callable(getattr(c, "pieces", None)) and hasattr(c, "name")):
            # a context read in pieces is told by memagent.chunking.TextSource's protocol (pieces() and a name;
            # that module sits above this one)
            missing = " (it has pieces() but no name, which a TextSource needs too)" if callable(getattr(c, "pieces", None)) else ""
            raise TypeError(f"Sample {self.id!r}: context must be a string or a TextSource, got {type(c).__name__} "
                            f"{c!r:.60}{missing}; read a file's text first (Path(...).read_text()), or give "
                            "MemoryAgent.answer the path")
        if self.answers is None:  # as "answers": null reads from a file
            object.__setattr__(self, "answers", ())
        if self.metadata is None:
            object.__setattr__(self, "metadata", {})
        elif not isinstance(self.metadata, dict):
            raise TypeError(f"Sample {self.id!r}: metadata must be a dict, got {type(self.metadata).__name__}")
        # a bare string would otherwise be taken for a sequence of one-character answers
        if isinstance(self.answers, str):
            raise TypeError(f"Sample {self.id!r}: answers must be a tuple of strings, got the string "
                            f"{self.answers!r}; write answers=({self.answers!r},)")
        if not isinstance(self.answers, tuple):
            object.__setattr__(self, "answers", tuple(self.answers))
        if not all(isinstance(a, str) for a in self.answers):
            raise TypeError(f"Sample {self.id!r}: answers must be strings, got {list(self.answers)!r}")

    @property
    def has_gold_answer(self) -> bool:
        """Whether some gold answer is not blank (``[""]`` scores 0 under every metric, and gives no reward)."""
        return any(a.strip() for a in self.answers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "question": self.question,
            "context": self.context,
            "answers": list(self.answers),
            "metadata": dict(self.metadata),
        }


@dataclass(frozen=True)
class Chunk:
    """A consecutive slice of a document's tokens.

    Attributes:
        index: 0-based position of the chunk in the document.
        start_token, end_token: the slice ``[start_token, end_token)`` of the document's token ids.
        start_char, end_char: the slice of the document text this chunk covers (characters); the texts of
            all chunks of a document, joined, are the document text exactly.
        text: ``document[start_char:end_char]``.
    """

    index: int
    start_token: int
    end_token: int
    start_char: int
    end_char: int
    text: str

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Request:
    """One chat completion request, as the agent loop hands it to a backend.

    Attributes:
        messages: the conversation (the agent sends an optional system message and one user message).
        max_tokens: cap on generated tokens.
        temperature, top_p: sampling settings (temperature 0 means greedy).
        seed: sampling seed, when the backend supports one.
        request_id: a readable id (``<sample id>/<turn>``) used in errors and logs.
        sampling: extra sampling settings that are off their default, by memagent's name (e.g.
            ``{"repetition_penalty": 1.1}``); each backend maps them to its engine's names and refuses one it
            cannot apply (:mod:`memagent.backends.sampling`).
        content_tokens: tokens of the messages' contents as the sender counted them (no chat template; at most
            the true count), so a server backend checks the server's prompt count without re-tokenizing the
            prompt; ``None``: not counted.
        affinity: requests with the same key prefer the same server (its prefix cache); the agent uses the
            sample id (``None``: no preference).
    """

    messages: tuple[Message, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    request_id: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)
    content_tokens: int | None = None
    affinity: str | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Completion:
    """What a backend returns for one request.

    Attributes:
        text: generated text (empty on error).
        token_ids: the exact generated token ids, shape ``(T_resp,)``, when the backend exposes them
            (in-process backends do); the training path uses these, never a re-tokenisation of ``text``.
        prompt_token_ids: the exact prompt token ids the model saw, shape ``(T_prompt,)``, when available.
        finish_reason: "stop" (end of turn), "length" (hit max_tokens) or "error".
        usage: prompt/completion token counts as reported by the backend.
        seconds: wall time of the call (for a batched call, the batch's time shared out evenly).
        error: the error message when ``finish_reason == "error"``.
        token_logprobs: ``(T_resp,)`` log-probability of each of ``token_ids`` under ``softmax(logits / T)`` at
            the request's temperature (``T = 1`` for greedy requests), before top-p truncation, when the backend
            computes them (the batched llama.cpp backend does); ``None`` otherwise.
    """

    text: str
    finish_reason: FinishReason
    usage: Usage = Usage()
    token_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    seconds: float = 0.0
    error: str | None = None
    token_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Turn:
    """One conversation of a trajectory: a memory update (one chunk) or the final answer.

    Attributes:
        kind: "update" or "final".
        chunk_index: index of the chunk read in this turn; ``None`` for the final turn.
        prompt_tokens, completion_tokens: token counts of this call.
        memory: for an update turn, the memory text after it; for the final turn, the memory it answered from.
        output: the raw completion text.
        finish_reason: as reported by the backend.
        seconds: wall time of the call.
        chunk_chars: for an update turn, the ``[start, end)`` character range of the chunk in the document
            the agent read (after optional truncation); ``None`` for the final turn.
        context_chars: for an update turn, the ``[start, end)`` ranges of the sample's original context that the
            chunk covers (one range; two where it spans the center-truncation cut); ``None`` for the final turn.
        prompt_token_ids, response_token_ids: exact ids when the backend exposes them (used by training;
            not written to trace files).
        response_token_logprobs: ``(T_resp,)`` sampling log-probabilities of ``response_token_ids`` when the
            backend returns them (``Completion.token_logprobs``); not written to trace files.
    """

    kind: TurnKind
    chunk_index: int | None
    prompt_tokens: int
    completion_tokens: int
    memory: str
    output: str
    finish_reason: FinishReason
    seconds: float
    chunk_chars: tuple[int, int] | None = None
    context_chars: tuple[tuple[int, int], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    response_token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    response_token_logprobs: tuple[float, ...] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("prompt_token_ids")
        d.pop("response_token_ids")
        d.pop("response_token_logprobs")
        return d


@dataclass(frozen=True)
class Trajectory:
    """All conversations the agent held for one sample, and its answer.

    Attributes:
        sample_id: the sample's id.
        question: the question.
        turns: update turns in chunk order, then the final turn (absent if the sample failed earlier).
        response: raw text of the final answer turn ("" if it failed).
        answer: the answer extracted from ``response`` (see :mod:`memagent.answers`).
        extraction: how the answer was extracted ("boxed", "answer_is", "raw", "empty").
        document_tokens: length of the document read, in model tokens (after optional truncation).
        error: error message if any call failed; ``None`` otherwise.
        prompt_hash: hash of the prompt templates used.
    """

    sample_id: str
    question: str
    turns: tuple[Turn, ...]
    response: str
    answer: str
    extraction: str
    document_tokens: int
    error: str | None = None
    prompt_hash: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def memory(self) -> str:
        """The final memory (what the answer turn saw)."""
        return self.turns[-1].memory if self.turns else ""

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "question": self.question,
            "answer": self.answer,
            "extraction": self.extraction,
            "response": self.response,
            "document_tokens": self.document_tokens,
            "error": self.error,
            "prompt_hash": self.prompt_hash,
            "turns": [t.to_dict() for t in self.turns],
        }
