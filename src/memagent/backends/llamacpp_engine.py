"""Batched llama.cpp decoding with shared prompt prefixes: the engine under the batched llamacpp backend.

One :meth:`BatchEngine.run` call decodes its jobs as parallel sequences of one llama.cpp context. Jobs whose
prompts share a long common prefix (the G rollouts of one question reading the same chunk, when the template
puts the chunk before the memory) form a prefix group: the prefix is evaluated once and the other members
get its KV cells, then every member evaluates only its own suffix. Generation then advances all sequences
in lock step, one token each per ``llama_decode``, until each stops or reaches its cap.

KV layout: with ``kv_unified=False`` (the default) every sequence has its own KV stream, so a token attends
only over its own sequence's cells, and a group's prefix is copied stream to stream; with ``kv_unified=True``
all sequences share one buffer, the prefix cells are shared (no copy) but every token's attention spans all
cells in use. Sampling is per job: a llama.cpp sampler chain ``temperature -> top-p -> dist(seed)`` (greedy
at temperature 0), so a job's tokens depend on its own seed, not on the other jobs of the batch.

Source: llama.cpp ``examples/batched`` and ``examples/parallel`` (several sequences in one context;
``llama_memory_seq_cp`` to share a prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from memagent.errors import BackendError, ConfigError


@dataclass(frozen=True)
class Job:
    """One generation: a prompt in token ids and how to sample its continuation.

    Attributes:
        prompt_ids: ``(T_prompt,)`` exact prompt ids (at least one).
        max_tokens: cap on generated tokens.
        temperature: 0 = greedy.
        top_p: nucleus mass in ``(0, 1]``, applied after the temperature.
        seed: seed of this job's sampler.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class JobResult:
    """What one job produced.

    Attributes:
        token_ids: sampled ids, ``(T_resp,)``; the stop token is the last one when ``finish == "stop"`` and
            the engine keeps stop tokens.
        logprobs: ``(T_resp,)`` log-probability of each sampled id under ``softmax(logits / T)`` at the job's
            temperature (``T = 1`` for greedy jobs), before top-p truncation.
        finish: ``"stop"`` (an end-of-generation token), ``"length"`` (hit ``max_tokens``) or ``"error"``.
        error: what failed, when ``finish == "error"``.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "length"
    error: str | None = None


@dataclass(frozen=True)
class PrefixGroup:
    """Jobs evaluated from one shared prompt prefix.

    Attributes:
        members: job indices; ``members[0]`` is the leader, whose sequence holds the prefix first.
        shared_tokens: prompt tokens every member shares (evaluated once); at most the shortest member's
            prompt length minus one, so every member evaluates at least its last prompt token itself.
    """

    members: tuple[int, ...]
    shared_tokens: int


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences, in tokens."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def plan_prefix_groups(prompts: Sequence[Sequence[int]], min_shared_tokens: int = 32) -> list[PrefixGroup]:
    """Group prompts so that sharing each group's common prefix saves the most prompt tokens.

    A group of ``k`` prompts sharing ``s`` tokens saves ``(k - 1) * s`` token evaluations. In lexicographic
    order of the prompts, a set's common prefix is the smallest common prefix of neighbours within its range,
    so the best grouping is a segmentation of that order, found by dynamic programming (``O(N^2)``). Only
    prefixes of at least ``min_shared_tokens`` are shared. The G rollouts of a question (sharing everything up
    to their memory) thus form one group even when all questions also share the template's opening.

    Args:
        prompts: ``N`` prompts as token ids (each at least one token).
        min_shared_tokens: shortest prefix worth sharing, in tokens.

    Returns:
        The groups, ordered by their first job index, members ascending; every index ``0..N-1`` is in exactly
        one; a group of one shares nothing.
    """
    n = len(prompts)
    order = sorted(range(n), key=lambda i: (tuple(prompts[i]), i))
    lcp = [min(common_prefix_tokens(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1)
           for a, b in zip(order, order[1:])]
    floor = max(1, min_shared_tokens)
    best, start, share = [0] * (n + 1), list(range(-1, n)), [0] * (n + 1)  # over order[:j]
    for j in range(1, n + 1):
        best[j], start[j], share[j] = best[j - 1], j - 1, 0  # order[j - 1] alone
        low = None
        for i in range(j - 2, -1, -1):  # the last group is order[i:j]
            low = lcp[i] if low is None else min(low, lcp[i])
            if low < floor:
                break
            if best[i] + (j - i - 1) * low > best[j]:
                best[j], start[j], share[j] = best[i] + (j - i - 1) * low, i, low
    groups, j = [], n
    while j > 0:
        members = tuple(sorted(order[start[j]:j]))
        groups.append(PrefixGroup(members, share[j]))
        j = start[j]
    return sorted(groups, key=lambda g: g.members[0])


def plan_waves(groups: Sequence[PrefixGroup], n_seq_max: int) -> list[list[PrefixGroup]]:
    """Pack groups into waves of at most ``n_seq_max`` sequences, in order, filling each wave before the next: a
    group that does not fit the room left is split, and its pieces share the same prefix (a piece of one
    shares nothing). ``N`` jobs take ``ceil(N / n_seq_max)`` waves."""
    waves: list[list[PrefixGroup]] = [[]]
    room = n_seq_max
    for g in groups:
        rest = g.members
        while rest:
            if room == 0:
                waves.append([])
                room = n_seq_max
            part, rest = rest[:room], rest[room:]
            waves[-1].append(PrefixGroup(part, g.shared_tokens if len(part) > 1 else 0))
            room -= len(part)
    return [w for w in waves if w]


def log_softmax_at(logits: np.ndarray, token: int, temperature: float) -> float:
    """``log softmax(logits / T)[token]`` in float64 (``T = 1`` when ``temperature <= 0``)."""
    t = temperature if temperature > 0 else 1.0
    z = logits.astype(np.float64) / t
    m = z.max()
    return float(z[token] - m - np.log(np.exp(z - m).sum()))


class BatchEngine:
    """Several llama.cpp sequences in one context, with prefix sharing (see module docstring).

    Args:
        model: a loaded ``llama_model_p`` (owned by the caller, who keeps it alive).
        n_seq_max: parallel sequences (jobs beyond this run in later waves).
        n_ctx_seq: context window of each sequence in tokens (prompt + generated).
        n_threads: CPU threads.
        n_batch: tokens per ``llama_decode`` call while evaluating prompts.
        kv_unified: one KV buffer for all sequences (see module docstring).
        flash_attn: llama.cpp's flash attention kernel.
        min_shared_tokens: shortest common prompt prefix worth sharing, in tokens.

    Raises:
        ConfigError: a setting out of range.
        BackendError: llama.cpp cannot create the context.
    """

    def __init__(self, model, n_seq_max: int = 8, n_ctx_seq: int = 4096, n_threads: int = 1, n_batch: int = 512,
                 kv_unified: bool = False, flash_attn: bool = False, min_shared_tokens: int = 32):
        import llama_cpp as L

        for knob, v in (("n_seq_max", n_seq_max), ("n_ctx_seq", n_ctx_seq), ("n_threads", n_threads), ("n_batch", n_batch)):
            if v < 1:
                raise ConfigError(f"{knob} must be >= 1, got {v}")
        self._L = L
        p = L.llama_context_default_params()
        p.n_ctx = n_seq_max * n_ctx_seq
        p.n_batch = p.n_ubatch = n_batch
        p.n_seq_max = n_seq_max
        p.n_threads = p.n_threads_batch = n_threads
        p.kv_unified = kv_unified
        p.no_perf = True
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = L.llama_init_from_model(model, p)
        if not self.ctx:
            raise BackendError(f"llama.cpp could not create a context of {n_seq_max} x {n_ctx_seq} tokens")
        self._mem = L.llama_get_memory(self.ctx)
        self._n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.n_seq_max, self.n_ctx_seq, self.n_batch = n_seq_max, n_ctx_seq, n_batch
        self.kv_unified, self.min_shared_tokens = kv_unified, min_shared_tokens
        self._batch = L.llama_batch_init(max(n_batch, n_seq_max), 0, n_seq_max)
        #: prompt tokens evaluated and skipped thanks to shared prefixes, over the engine's life
        self.stats = {"prompt_tokens_evaluated": 0, "prompt_tokens_shared": 0, "generated_tokens": 0}

    # ------------------------------------------------------------------------------------------ decoding
    def _decode(self, items: list[tuple[int, int, Sequence[int], bool]]) -> None:
        """One ``llama_decode`` of ``(token, pos, seq_ids, wants_logits)`` items."""
        b = self._batch
        for i, (tok, pos, seqs, want) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = len(seqs)
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
            b.logits[i] = want
        b.n_tokens = len(items)
        rc = self._L.llama_decode(self.ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc} on a batch of {len(items)} tokens")

    def _evaluate(self, spans: list[tuple[Sequence[int], int, Sequence[int], int | None]],
                  on_logits: Callable[[int, int], None]) -> None:
        """Evaluate prompt spans ``(tokens, first_pos, seq_ids, slot_for_last_logits)`` in ``n_batch``-token
        decodes; after each decode, ``on_logits(slot, batch_index)`` for the spans that ended in it."""
        pending: list[tuple[int, int, Sequence[int], bool]] = []
        ended: list[tuple[int, int]] = []
        for tokens, start, seqs, slot in spans:
            for k, tok in enumerate(tokens):
                last = k == len(tokens) - 1
                want = last and slot is not None
                if want:
                    ended.append((slot, len(pending)))
                pending.append((int(tok), start + k, seqs, want))
                if len(pending) == self.n_batch:
                    self._decode(pending)
                    for s, idx in ended:
                        on_logits(s, idx)
                    pending, ended = [], []
        if pending:
            self._decode(pending)
            for s, idx in ended:
                on_logits(s, idx)

    def _logits(self, idx: int) -> np.ndarray:
        ptr = self._L.llama_get_logits_ith(self.ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def _sampler(self, job: Job):
        L = self._L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if job.temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(job.temperature))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(job.top_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(job.seed & 0xFFFFFFFF))
        return chain

    # ------------------------------------------------------------------------------------------- public
    def run(self, jobs: Sequence[Job], is_stop: Callable[[int], bool], keep_stop: bool = True) -> list[JobResult]:
        """Generate every job; returns one result per job, in job order.

        Args:
            jobs: the generations; each prompt plus ``max_tokens`` must fit ``n_ctx_seq``.
            is_stop: whether a token ends generation (end-of-generation tokens).
            keep_stop: put the stop token (and its log-probability) at the end of ``token_ids``.

        A wave that llama.cpp fails (no memory slot for one of its sequences) is run again one job at a time, so
        only the job that fails alone gets an error result.

        Raises:
            ConfigError: a job that does not fit a sequence's window, or has an empty prompt.
        """
        for k, j in enumerate(jobs):
            if not j.prompt_ids or len(j.prompt_ids) + j.max_tokens > self.n_ctx_seq:
                raise ConfigError(f"job {k}: a prompt of {len(j.prompt_ids)} tokens plus max_tokens={j.max_tokens} "
                                  f"does not fit the {self.n_ctx_seq}-token window of a sequence")
        results = [JobResult() for _ in jobs]
        groups = plan_prefix_groups([j.prompt_ids for j in jobs], self.min_shared_tokens)
        for wave in plan_waves(groups, self.n_seq_max):
            try:
                self._run_wave(wave, jobs, results, is_stop, keep_stop)
            except BackendError as e:
                members = [m for g in wave for m in g.members]
                if len(members) == 1:
                    results[members[0]] = JobResult(finish="error", error=str(e))
                    continue
                for m in members:  # one request's failure (no memory slot for it) must not fail the others
                    results[m] = JobResult()
                    try:
                        self._run_wave([PrefixGroup((m,), 0)], jobs, results, is_stop, keep_stop)
                    except BackendError as alone:
                        results[m] = JobResult(finish="error", error=str(alone))
        return results

    def _run_wave(self, wave: list[PrefixGroup], jobs: Sequence[Job], results: list[JobResult],
                  is_stop: Callable[[int], bool], keep_stop: bool) -> None:
        L = self._L
        L.llama_memory_clear(self._mem, False)  # metadata only: every cell is rewritten before it is read
        seq_of: dict[int, int] = {}  # job index -> sequence id
        for g in wave:
            for m in g.members:
                seq_of[m] = len(seq_of)
        samplers = {m: self._sampler(jobs[m]) for m in seq_of}
        pending: dict[int, int] = {}  # job -> next token to feed
        try:
            def take(m: int, idx: int) -> None:
                job, res = jobs[m], results[m]
                tok = int(L.llama_sampler_sample(samplers[m], self.ctx, idx))
                stop = is_stop(tok)
                if not stop or keep_stop:
                    res.token_ids.append(tok)
                    res.logprobs.append(log_softmax_at(self._logits(idx), tok, job.temperature))
                if stop:
                    res.finish = "stop"
                elif len(res.token_ids) >= job.max_tokens:
                    res.finish = "length"
                else:
                    pending[m] = tok

            self._prefill(wave, jobs, seq_of, take)
            while pending:
                order = list(pending)
                self._decode([(pending[m], len(jobs[m].prompt_ids) + len(results[m].token_ids) - 1, (seq_of[m],), True)
                              for m in order])
                self.stats["generated_tokens"] += len(order)
                pending.clear()
                for idx, m in enumerate(order):
                    take(m, idx)
        finally:
            for s in samplers.values():
                L.llama_sampler_free(s)

    def _prefill(self, wave: list[PrefixGroup], jobs: Sequence[Job], seq_of: dict[int, int],
                 take: Callable[[int, int], None]) -> None:
        """Evaluate each group's shared prefix once, give it to the other members, then every suffix."""
        L = self._L
        prefixes = []
        for g in wave:
            if g.shared_tokens and len(g.members) > 1:
                lead = jobs[g.members[0]].prompt_ids[: g.shared_tokens]
                seqs = [seq_of[m] for m in g.members] if self.kv_unified else [seq_of[g.members[0]]]
                prefixes.append((lead, 0, seqs, None))
                self.stats["prompt_tokens_shared"] += g.shared_tokens * (len(g.members) - 1)
                self.stats["prompt_tokens_evaluated"] += g.shared_tokens
        if prefixes:
            self._evaluate(prefixes, lambda s, i: None)
            if not self.kv_unified:  # separate streams: copy the leader's whole stream (the prefix) to the others
                for g in wave:
                    if g.shared_tokens and len(g.members) > 1:
                        for m in g.members[1:]:
                            L.llama_memory_seq_cp(self._mem, seq_of[g.members[0]], seq_of[m], -1, -1)
        suffixes = []
        for g in wave:
            start = g.shared_tokens if len(g.members) > 1 else 0
            for m in g.members:
                tail = jobs[m].prompt_ids[start:]
                suffixes.append((tail, start, [seq_of[m]], m))
                self.stats["prompt_tokens_evaluated"] += len(tail)
        self._evaluate(suffixes, take)

    def close(self) -> None:
        """Free the context and the batch (the model stays with its owner)."""
        if self.ctx:
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self.ctx)
            self.ctx = None
