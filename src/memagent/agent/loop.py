"""The memory agent loop: read a document chunk by chunk, overwrite a text memory, answer from memory.

Source: paper section 2 / reference doc section 1: memory ``m_0`` = a no-memory marker,
``m_k = f(q, c_k, m_{k-1})`` for every chunk ``c_k``, answer from ``(q, m_K)`` alone. Every call is an
independent single-turn chat, so the prompt size is bounded by question + memory cap + one chunk whatever
the document length, and time grows linearly with the number of chunks.

Scheduling: calls for one sample are sequential by nature, so throughput comes from advancing many samples
together; up to ``batch_size`` samples are active at once, and a finished sample leaves while the next
waiting sample takes its place.

- In-process backends (``backend.batched``): lock step. At each step every active sample contributes exactly
  one request (its next update, or its final turn once its document is exhausted), and the step's requests
  go to the backend as one batched ``generate`` call.
- Servers: every active sample runs its own chain of calls in a worker thread, so a slow request delays only
  its own sample; the server sees up to the backend's ``concurrency`` requests in flight (``batch_size``
  for a server backend without that setting).

The reference's training loop instead holds every sample's final turn until the longest document of the
batch is read (doc section 4.4).

Budgets are checked before any call: for every sample, template + question + memory cap + chunk + new
tokens must fit the backend's context window, for the update and for the final call separately.
"""

from __future__ import annotations

import os
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from memagent.agent.budget import CLI_SETTING_NAMES, budget_fixes
from memagent.agent.config import AgentConfig
from memagent.agent.progress import Bars
from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
from memagent.answers import extract_answer, strip_reasoning
from memagent.backends.base import DEFAULT_CHAT_OVERHEAD_TOKENS, Backend
from memagent.chunking import ChunkStream, TextSource, source_ranges
from memagent.errors import BackendError, ConfigError
from memagent.runfiles.trace import prune_trace, trace_rows, write_trace  # noqa: F401 - moved there; older imports
from memagent.tokenization import Tokenizer, count_tokens, load_tokenizer, lone_surrogate
from memagent.types import Chunk, Completion, Message, Request, Sample, Trajectory, Turn


@dataclass
class _State:
    """Mutable progress of one sample inside the loop: its chunks are cut as they are read (only the current
    one is held)."""

    sample: Sample
    chunks: ChunkStream
    chunk: Chunk | None = None  # the chunk the next update reads; None once the document is read
    next_chunk: int = 0
    question_tokens: int | None = None
    memory: str = ""
    turns: list[Turn] = field(default_factory=list)
    result: Trajectory | None = None
    prefetched: Future | None = None  # the next chunk, being cut in the background while a request is out

    def advance(self) -> None:
        if self.prefetched is not None:
            fut, self.prefetched = self.prefetched, None
            self.chunk = fut.result()
        else:
            self.chunk = next(self.chunks, None)

    @property
    def document_tokens(self) -> int:
        if self.prefetched is not None:  # the next chunk is being cut in the background: the stream is not
            fut, self.prefetched = self.prefetched, None  # to be read from two threads at once
            fut.result()
        return self.chunks.count_rest()


TurnCallback = Callable[[Sample, Turn], None]
ResultCallback = Callable[[Sample, Trajectory], None]


class MemoryAgent:
    """Answers questions over long documents through any :class:`Backend`.

    Args:
        backend: the chat model.
        config: budgets and sampling (:class:`AgentConfig`).
        templates: the prompts; default the file ``config.templates`` names, else :data:`DEFAULT_TEMPLATES`.
        tokenizer: the model's tokenizer, used for chunking and budgets, or a spec as ``--tokenizer`` takes it
            (``"bytes"``, ``"smollm2"``, a tokenizer.json, an HF folder, a .gguf); default ``backend.tokenizer``.
        keep_token_ids: keep each turn's exact prompt and response token ids (training needs them); without
            them a trajectory holds only texts, so a sample's memory does not grow with its document.

    Raises:
        ConfigError: no tokenizer is available (servers need one passed explicitly), a tokenizer spec that does
            not load, or the templates file cannot be read.
        TypeError: ``backend`` is not a backend object or ``config`` not an :class:`AgentConfig`.
    """

    #: How budget errors name the settings (:meth:`check_budget`); a caller with other names sets its own.
    setting_names: Mapping[str, str] = CLI_SETTING_NAMES

    def __init__(
        self,
        backend: Backend,
        config: AgentConfig | None = None,
        templates: PromptTemplates | None = None,
        tokenizer: Tokenizer | None = None,
        keep_token_ids: bool = True,
    ):
        if isinstance(backend, type) or not callable(getattr(backend, "generate", None)):
            raise TypeError(f"MemoryAgent: backend must be a backend object (memagent.backends.make_backend('llamacpp'), "
                            f"memagent.embedded.load() ...), got {type(backend).__name__} {backend!r}")
        if config is not None and not isinstance(config, AgentConfig):
            raise TypeError(f"MemoryAgent: config must be an AgentConfig, got {type(config).__name__}; write "
                            "AgentConfig(chunk_tokens=..., memory_tokens=...)")
        if isinstance(tokenizer, str):  # a spec, as --tokenizer takes it ("bytes", "smollm2", a tokenizer.json)
            tokenizer = load_tokenizer(tokenizer)
        if isinstance(templates, (str, os.PathLike)):  # a built-in name or a YAML file, as AgentConfig.templates
            templates = PromptTemplates.from_file(templates)
        if templates is not None and not isinstance(templates, PromptTemplates):
            raise TypeError(f"MemoryAgent: templates must be PromptTemplates (or a built-in name or YAML file), got "
                            f"{type(templates).__name__}; write PromptTemplates.from_file(...)")
        self.backend = backend
        self.keep_token_ids = keep_token_ids
        self.config = config or AgentConfig()  # the setters below also derive the sampling options and budgets
        if templates is None:
            templates = PromptTemplates.from_file(self.config.templates) if self.config.templates else DEFAULT_TEMPLATES
        self.templates = templates
        self.tokenizer = tokenizer or getattr(backend, "tokenizer", None)
        if self.tokenizer is None:
            raise ConfigError(
                f"backend {backend.name!r} has no tokenizer: pass one (e.g. --tokenizer path/to/tokenizer.json) so "
                "chunks and budgets can be counted in the model's tokens"
            )
        if not callable(getattr(self.tokenizer, "encode", None)):
            raise TypeError(f"MemoryAgent: tokenizer must be a tokenizer object (with encode) or a spec such as "
                            f"'bytes' or 'smollm2', got {type(self.tokenizer).__name__} {self.tokenizer!r:.60}")

    @property
    def config(self) -> AgentConfig:
        """The agent's settings; assigning another AgentConfig recomputes what was derived from it."""
        return self._config

    @config.setter
    def config(self, value: AgentConfig) -> None:
        if not isinstance(value, AgentConfig):
            raise TypeError(f"MemoryAgent.config must be an AgentConfig, got {type(value).__name__}")
        self._config, self._sampling, self._fixed = value, value.sampling_options(), {}

    @property
    def templates(self) -> PromptTemplates:
        """The prompt templates; assigning others re-measures the budgets' fixed prompt tokens."""
        return self._templates

    @templates.setter
    def templates(self, value: PromptTemplates) -> None:
        if not isinstance(value, PromptTemplates):
            raise TypeError(f"MemoryAgent.templates must be PromptTemplates, got {type(value).__name__}")
        self._templates, self._fixed = value, {}

    # ----------------------------------------------------------------------------------------- budgets
    def _prompt_tokens(self, messages: Sequence[Message]) -> int:
        exact = self.backend.count_prompt_tokens(messages)
        if exact is not None:
            return exact
        return sum(count_tokens(self.tokenizer, m.content) for m in messages) + DEFAULT_CHAT_OVERHEAD_TOKENS

    def _fixed_tokens(self, kind: str) -> int:
        """Tokens of a chat-wrapped template with empty slots (measured once)."""
        if kind not in self._fixed:
            t = self.templates
            msgs = t.messages_update("", "", "") if kind == "update" else t.messages_final("", "")
            marker = count_tokens(self.tokenizer, t.no_memory)
            self._fixed[kind] = self._prompt_tokens(msgs) - marker  # the empty memory rendered the marker
        return self._fixed[kind]

    def check_budget(self, question: str, sample_id: str = "?", names: Mapping[str, str] | None = None) -> None:
        """Check that both calls for ``question`` fit the backend's context window.

        Args:
            question: the sample's question.
            sample_id: how the error names the sample.
            names: how the error names the settings to change: ``chunk_tokens``, ``memory_tokens``,
                ``final_tokens`` and ``window`` (default :attr:`setting_names`: the command-line flags unless the
                caller set others, as the trainer does with ``agent.chunk_tokens`` ...).

        Raises:
            ConfigError: naming the call, every term of the sum, and the setting to change; or the question holds
                a lone surrogate code point, which no tokenizer can encode.
        """
        _refuse_lone_surrogate(question, f"sample {sample_id}: the question")
        names = {**CLI_SETTING_NAMES, **self.setting_names, **(names or {})}
        window = self.backend.context_tokens
        if window is None:
            return
        c = self.config
        q = count_tokens(self.tokenizer, question)
        mem_in = max(c.memory_tokens, count_tokens(self.tokenizer, self.templates.no_memory))
        terms = {
            "update": [("template", self._fixed_tokens("update")), ("question", q), ("memory cap", mem_in),
                       ("chunk", c.chunk_tokens), ("slack", 2 * c.slack_tokens), ("new tokens", c.memory_tokens)],
            "final": [("template", self._fixed_tokens("final")), ("question", q), ("memory cap", mem_in),
                      ("slack", c.slack_tokens), ("new tokens", c.final_tokens)],
        }
        for call, parts in terms.items():
            need = sum(v for _, v in parts)
            if need > window:
                detail = " + ".join(f"{k} {v}" for k, v in parts)
                fixes = budget_fixes(call, need - window, need, q, c, mem_in,
                                     count_tokens(self.tokenizer, self.templates.no_memory), names)
                raise ConfigError(
                    f"sample {sample_id}: the {call} call needs {need} tokens ({detail}) but the context window of "
                    f"{self.backend.name} is {window} tokens. To fix: {'; or '.join(fixes)}"
                )

    # ------------------------------------------------------------------------------------------ loop
    def _prepare(self, sample: Sample) -> _State:
        # a document of whitespace only is read as empty: no update call (the reference strips the context), as the
        # warnings say (the answer rests on the question alone); a file or stream says so by its ``blank``
        ctx = sample.context
        blank = not ctx.strip() if isinstance(ctx, str) else getattr(ctx, "blank", False) is True
        st = _State(sample, ChunkStream("" if blank else ctx, self.tokenizer, self.config.chunk_tokens,
                                        self.config.max_context_tokens))
        st.advance()
        return st

    def _seed(self, sample_id: str, turn: int) -> int | None:
        if self.config.seed is None:
            return None
        return zlib.crc32(f"{self.config.seed}/{sample_id}/{turn}".encode()) & 0x7FFFFFFF

    def _content_tokens(self, kind: str) -> int:
        """Tokens of a template's message contents with empty slots (no chat wrapping, no memory marker)."""
        key = "content/" + kind
        if key not in self._fixed:
            t = self.templates
            msgs = t.messages_update("", "", "") if kind == "update" else t.messages_final("", "")
            marker = count_tokens(self.tokenizer, t.no_memory)
            self._fixed[key] = max(0, sum(count_tokens(self.tokenizer, m.content) for m in msgs) - marker)
        return self._fixed[key]

    def _request(self, st: _State) -> Request:
        c, t, q = self.config, self.templates, st.sample.question
        turn = len(st.turns)
        if st.question_tokens is None:
            st.question_tokens = count_tokens(self.tokenizer, q)
        memory = count_tokens(self.tokenizer, st.memory or t.no_memory)
        if st.chunk is not None:
            msgs = t.messages_update(q, st.memory, st.chunk.text)
            max_new, rid = c.memory_tokens, f"{st.sample.id}/chunk{st.next_chunk}"
            content = self._content_tokens("update") + st.chunk.num_tokens
        else:
            msgs = t.messages_final(q, st.memory)
            max_new, rid = c.final_tokens, f"{st.sample.id}/final"
            content = self._content_tokens("final")
        # the chunk's tokens in the document may merge differently alone: the slack keeps the count below the truth
        content = max(0, content + st.question_tokens + memory - c.slack_tokens)
        return Request(msgs, max_new, c.temperature, c.top_p, self._seed(st.sample.id, turn), rid, dict(self._sampling),
                       content_tokens=content, affinity=_affinity(st.sample.id))

    def _apply(self, st: _State, req: Request, comp: Completion) -> Turn:
        chunk = st.chunk
        is_update = chunk is not None
        ok = comp.finish_reason != "error"
        if is_update and ok:
            st.memory = strip_reasoning(comp.text).strip()
        turn = Turn(
            kind="update" if is_update else "final",
            chunk_index=st.next_chunk if is_update else None,
            prompt_tokens=comp.usage.prompt_tokens or len(comp.prompt_token_ids or ()),
            completion_tokens=comp.usage.completion_tokens or len(comp.token_ids or ()),
            memory=st.memory,
            output=comp.text,
            finish_reason=comp.finish_reason,
            seconds=comp.seconds,
            chunk_chars=(chunk.start_char, chunk.end_char) if chunk is not None else None,
            context_chars=_context_chars(st.chunks, chunk),
            prompt_token_ids=comp.prompt_token_ids if self.keep_token_ids else None,
            response_token_ids=comp.token_ids if self.keep_token_ids else None,
            response_token_logprobs=comp.token_logprobs if self.keep_token_ids else None,
        )
        st.turns.append(turn)
        s = st.sample
        if not ok:
            msg = comp.error or "backend returned an error"
            if self.config.strict:
                raise BackendError(msg, req.request_id)
            st.result = Trajectory(s.id, s.question, tuple(st.turns), "", "", "empty", st.document_tokens,
                                   error=msg if f"[request {req.request_id}]" in msg else f"{req.request_id}: {msg}",
                                   prompt_hash=self.templates.hash)
        elif is_update:
            st.next_chunk += 1
            st.advance()
        else:
            ext = extract_answer(comp.text)
            st.result = Trajectory(s.id, s.question, tuple(st.turns), comp.text, ext.answer, ext.method,
                                   st.document_tokens, prompt_hash=self.templates.hash)
        return turn

    def run(
        self,
        samples: Sequence[Sample] | Iterable[Sample],
        on_result: ResultCallback | None = None,
        on_turn: TurnCallback | None = None,
        progress: bool = False,
    ) -> list[Trajectory]:
        """Answer every sample; returns trajectories in input order.

        Args:
            samples: the questions and documents.
            on_result: called with each sample's trajectory as soon as it is finished (write results here).
            on_turn: called after every turn (e.g. to print the memory as it evolves).
            progress: show progress bars (samples done; turns done).

        Raises:
            ConfigError: an item is not a :class:`Sample`, a question or document is not a string, a question is
                empty, a question or document holds a lone surrogate code point, or a sample's calls cannot fit the context window (checked for all samples before the
                first call).
            BackendError: only with ``strict=True``, on the first failed request.
        """
        if not isinstance(samples, Sequence):
            if isinstance(samples, (Sample, Mapping)) or not isinstance(samples, Iterable):
                raise ConfigError(f"samples must be a list of Samples, got {type(samples).__name__} (one sample: "
                                  "[sample], or MemoryAgent.answer(question, document))")
            samples = list(samples)  # a generator: every budget is checked before the first call
        for k, s in enumerate(samples):
            if not isinstance(s, Sample):
                hint = (" (a dict: convert it with memagent.data.schema.sample_from_dict, or read a file with "
                        "memagent.data.io.read_samples)") if isinstance(s, dict) else ""
                raise ConfigError(f"samples[{k}] is a {type(s).__name__}, not a memagent Sample{hint}")
            _check_texts(s.id, s.question, s.context)
            if not s.question.strip():
                raise ConfigError(f"sample {s.id}: the question is empty")
            if isinstance(s.context, str):  # a streamed document is checked block by block as it is read
                _refuse_lone_surrogate(s.context, f"sample {s.id}: the document")
            self.check_budget(s.question, s.id)
        ids = [s.id for s in samples]
        if len(set(ids)) != len(ids):  # ids key requests, their seeds and the traces
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ConfigError(f"sample id {dup!r} appears more than once; give each sample its own id")
        bars = Bars(len(samples)) if progress else None
        run = self._run_lockstep if getattr(self.backend, "batched", True) else self._run_pipelined
        try:
            return run(samples, on_result, on_turn, bars)
        finally:
            if bars:
                bars.close()

    def _step(self, st: _State, req: Request, comp: Completion, on_turn, bars) -> bool:
        """Apply one completion; returns True when the sample is finished."""
        was_update = st.chunk is not None
        turn = self._apply(st, req, comp)
        if on_turn:
            on_turn(st.sample, turn)
        if bars:
            bars.turn_done()
            if st.result is not None:
                bars.sample_done(1 if was_update else 0)  # a failed update: the final turn never runs
            elif st.chunk is not None:  # the next chunk was cut: one more turn
                bars.add_turns(1)
        return st.result is not None

    def _admit(self, sample: Sample, bars) -> _State:
        st = self._prepare(sample)
        if bars:
            bars.add_turns(1 + (st.chunk is not None))
        return st

    def _run_lockstep(self, samples, on_result, on_turn, bars) -> list[Trajectory]:
        """In-process backends: one batched ``generate`` call per step over all active samples."""
        waiting = deque(range(len(samples)))
        active: list[tuple[int, _State]] = []
        results: list[Trajectory | None] = [None] * len(samples)
        while waiting or active:
            while waiting and len(active) < self.config.batch_size:
                i = waiting.popleft()
                active.append((i, self._admit(samples[i], bars)))
            requests = [self._request(st) for _, st in active]
            comps = self._generate(requests)
            still = []
            for (i, st), req, comp in zip(active, requests, comps):
                if not self._step(st, req, comp, on_turn, bars):
                    still.append((i, st))
                    continue
                results[i] = st.result
                if on_result:
                    on_result(st.sample, st.result)
            active = still
        return results  # type: ignore[return-value]

    def _run_pipelined(self, samples, on_result, on_turn, bars) -> list[Trajectory]:
        """Servers: each sample in flight runs its own chain of calls in a worker thread, so a slow request holds
        back only its own sample (the server batches whatever is in flight). Samples in flight: the backend's
        ``concurrency`` when it has one, else ``batch_size``. An exception in one sample (e.g. every server down)
        stops the others before their next call and starts no new sample; it is then raised."""
        from concurrent.futures import ThreadPoolExecutor

        lock = threading.Lock()  # callbacks and progress bars are called one at a time
        stop = threading.Event()
        # the next chunk of a sample is cut while its request is out (tokenizing overlaps the server's latency)
        cutter = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="memagent-chunks")

        def one(sample: Sample) -> Trajectory | None:
            if stop.is_set():
                return None
            try:
                st = self._admit(sample, None)
                if bars:
                    with lock:
                        bars.add_turns(1 + (st.chunk is not None))
                while not stop.is_set():
                    req = self._request(st)
                    if st.chunk is not None:
                        st.prefetched = cutter.submit(next, st.chunks, None)
                    (comp,) = self._generate([req])
                    with lock:
                        done = self._step(st, req, comp, on_turn, bars)
                        if done and on_result:
                            on_result(st.sample, st.result)
                    if done:
                        return st.result
                return None
            except BaseException:
                stop.set()
                raise

        workers = getattr(self.backend, "concurrency", None) or self.config.batch_size
        with cutter, ThreadPoolExecutor(max_workers=max(1, min(workers, len(samples)))) as pool:
            futures = [pool.submit(one, s) for s in samples]
            try:  # the first exception in sample order, or Ctrl-C while waiting: no sample starts another call
                return [f.result() for f in futures]  # (the pool's exit waits for the requests in flight only)
            except BaseException:
                stop.set()
                for g in futures:
                    g.cancel()
                raise

    def _generate(self, requests: list[Request]) -> list[Completion]:
        t0 = time.perf_counter()
        comps = self.backend.generate(requests)
        if len(comps) != len(requests):
            raise BackendError(f"{self.backend.name} returned {len(comps)} completions for {len(requests)} requests")
        share = (time.perf_counter() - t0) / max(len(requests), 1)
        return [c if c.seconds else _with_seconds(c, share) for c in comps]

    def answer(self, question: str, document, sample_id: str = "0", **kwargs) -> Trajectory:
        """Answer one question over one document (see :meth:`run` for keyword arguments).

        Args:
            question: the question.
            document: the text; or a path (``pathlib.Path``), a binary file object or an iterable of text
                pieces, read in pieces as the chunks are needed (:func:`memagent.data.sources.document_source`), so
                a document larger than memory streams.
            sample_id: the trajectory's sample id.
        """
        from memagent.data.sources import document_source

        source = document_source(document)
        _check_texts(sample_id, question, source)  # before Sample's own TypeError, as run() words it
        return self.run([Sample(sample_id, question, source)], **kwargs)[0]


def _check_texts(sample_id: str, question: Any, context: Any) -> None:
    """Raises ConfigError unless the question is a string and the document a string or a TextSource."""
    if not isinstance(question, str) or not isinstance(context, (str, TextSource)):
        raise ConfigError(f"sample {sample_id}: question and document must be strings, got "
                          f"{type(question).__name__} and {type(context).__name__} (a document may also be "
                          "a path or an iterable of text given to MemoryAgent.answer, or a TextSource)")


def _affinity(sample_id: str) -> str:
    """The server-affinity key of a sample: its id, without the ``#g<j>`` of an RL group member (the members
    share their prompts' prefixes, so they prefer one server too)."""
    return re.sub(r"#g\d+$", "", sample_id)


def _context_chars(chunks: ChunkStream, chunk: Chunk | None) -> tuple[tuple[int, int], ...] | None:
    """The ranges of the sample's context that ``chunk`` covers (two where it spans the truncation cut)."""
    if chunk is None:
        return None
    if chunks.kept is None:  # not truncated (the length is not known yet): the chunk's own range
        return ((chunk.start_char, chunk.end_char),)
    return source_ranges(chunks.kept, chunk.start_char, chunk.end_char)


def _refuse_lone_surrogate(text: str, what: str) -> None:
    if (at := lone_surrogate(text)) is not None:
        raise ConfigError(f"{what} holds a lone surrogate U+{ord(text[at]):04X} at character {at}, which no "
                          "tokenizer can encode; remove it")


def _with_seconds(c: Completion, seconds: float) -> Completion:
    from dataclasses import replace

    return replace(c, seconds=seconds)
