"""In-process transformers backend: batched ``generate`` on a model that training can share.

It is the rollout engine for CPU training: the trainer hands it its policy module, so rollouts always use
the current weights, and every completion carries the exact sampled token ids and prompt ids.

Token ids: ``Completion.token_ids`` are the generated ids without padding and **including** the stop token
(EOS or end-of-turn) when the model emitted one (``finish_reason="stop"``). Training rows are built from
these ids, so the model is trained to stop. ``Completion.text`` is decoded without the stop token and
without special tokens.

Prompts are rendered with the tokenizer's chat template through :func:`memagent.backends.chat.render_pieces`:
template text is tokenized with special tokens parsed, message contents as plain text, so a document that
contains ``<|im_end|>`` cannot inject a control token.
"""

from __future__ import annotations

import os
import time
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

from memagent.backends.base import check_context_tokens, check_request
from memagent.backends.chat import encode_pieces, messages_as_dicts, render_pieces
from memagent.backends.sampling import engine_options
from memagent.errors import ConfigError
from memagent.tokenization import HFTokenizer
from memagent.types import Completion, Message, Request, Usage

#: End-of-turn markers of common chat templates; those present in the vocabulary also stop generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def load_hf_model(path: str | os.PathLike, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from an HF directory or a GGUF file.

    A GGUF file is loaded with transformers' GGUF support (dequantized to ``dtype``); the GGUF quantizer
    transformers attaches is dropped, because the weights are dense and trainers refuse "purely quantized"
    models (ENVIRONMENT.md §3).

    Args:
        path: a model directory with ``config.json``, or a ``*.gguf`` file.
        dtype: ``"bfloat16"`` or ``"float32"``.

    Returns:
        ``(model, tokenizer)`` (transformers objects); the model is in eval mode.

    Raises:
        ConfigError: path missing, a folder without config.json or tokenizer files, files transformers cannot load
            (truncated, corrupt, not a model), or unknown dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    p = os.path.expanduser(os.fspath(path))
    if p.endswith(".gguf"):
        if not os.path.isfile(p):
            raise ConfigError(f"GGUF file not found: {p!r}")
    elif os.path.isdir(p):
        missing = [what for what, names in (("config.json", ("config.json",)),
                                            ("tokenizer files", ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")))
                   if not any(os.path.isfile(os.path.join(p, n)) for n in names)]
        if missing:
            raise ConfigError(f"hf backend: model folder {p!r} lacks {' and '.join(missing)}; give a folder saved by "
                              "save_pretrained (model and tokenizer), or a .gguf file")
    else:
        raise ConfigError(f"model path {p!r} is neither a model directory nor a .gguf file")
    try:
        if p.endswith(".gguf"):
            d, name = os.path.dirname(os.path.abspath(p)), os.path.basename(p)
            tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch_dtype, **_dense_gguf(name))
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        else:
            tok = AutoTokenizer.from_pretrained(p)
            model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype)
    except Exception as e:  # a truncated or corrupt file, an unknown architecture: what transformers says, named
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise ConfigError(f"hf backend: cannot load the model at {p!r} ({type(e).__name__}: {first}); check that its "
                          "files are complete (config.json, weights, tokenizer)") from e
    model.eval()
    return model, tok


def _dense_gguf(name: str) -> dict[str, Any]:
    """Ask transformers to unpack every GGUF weight into a dense tensor. Recent transformers can keep the
    weights packed behind GGUF matmul kernels (when the ``kernels`` package is installed), which cannot be
    trained; older versions always dequantize and lack ``GgufConfig``."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=name, dequantize=True)}


def _torch_dtype(dtype: str):
    import torch

    table = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in table:
        raise ConfigError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    return table[dtype]


def request_seed(base: int, requests: Sequence[Request]) -> int:
    """A 31-bit sampling seed from a backend's base seed and the requests' seeds and ids: the same requests
    sample the same tokens again, and different ones draw differently."""
    key = "|".join(f"{r.seed}:{r.request_id}" for r in requests)
    return zlib.crc32(f"{base}|{key}".encode()) & 0x7FFFFFFF


class ChatTokens:
    """An HF tokenizer's chat template as token ids: prompts, stop tokens, padding and completions.

    Shared by the in-process engines (:class:`HFBackend`, :class:`memagent.backends.vllm.VLLMBackend`), which
    both return exact token ids for training. Prompts are rendered with the chat template through
    :func:`memagent.backends.chat.render_pieces`: template text is tokenized with special tokens parsed,
    message contents as plain text, so a document that contains ``<|im_end|>`` cannot inject a control token.

    Args:
        tokenizer: a transformers fast tokenizer with a chat template.
        name: model name recorded with the tokenizer.
        model_eos: the model's generation-config ``eos_token_id`` (an id, a list of ids or ``None``); these
            stop generation too.

    Raises:
        ConfigError: the tokenizer has no chat template, or no EOS or end-of-turn token.
    """

    def __init__(self, tokenizer: Any, name: str, model_eos: Any = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer of {name!r} has no chat template (a base model?): add chat_template.jinja to the model "
                "folder (or chat_template in its tokenizer_config.json), or set tokenizer.chat_template from Python"
            )
        from tokenizers import Tokenizer as _Raw

        self.hf_tokenizer = tokenizer
        self.tokenizer = HFTokenizer(tokenizer, name=name)
        self._template_tok = _Raw.from_str(tokenizer.backend_tokenizer.to_str())
        self._template_tok.no_truncation()
        self._template_tok.no_padding()
        self._template_tok.encode_special_tokens = False
        self.stop_ids = self._stop_ids(model_eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    def _stop_ids(self, model_eos: Any) -> list[int]:
        tok = self.hf_tokenizer
        ids: list[int] = []
        for x in [tok.eos_token_id] + (model_eos if isinstance(model_eos, list) else [model_eos]):
            if x is not None and x not in ids:
                ids.append(int(x))
        vocab = tok.get_vocab()
        for t in END_OF_TURN_TOKENS:
            if t in vocab and vocab[t] not in ids:
                ids.append(int(vocab[t]))
        if not ids:
            raise ConfigError("the tokenizer has no EOS or end-of-turn token; generation could never stop")
        return ids

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the chat-templated prompt (with the generation prompt), contents as plain text."""
        render = lambda msgs: self.hf_tokenizer.apply_chat_template(  # noqa: E731
            msgs, tokenize=False, add_generation_prompt=True
        )
        pieces = render_pieces(messages, render)
        return encode_pieces(
            pieces,
            lambda s: self._template_tok.encode(s, add_special_tokens=False).ids,
            self.tokenizer.encode,
        )

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int | None:
        return len(self.prompt_ids(messages))

    def prompt_or_error(self, request: Request, context_tokens: int | None) -> tuple[list[int], Completion | None]:
        """``(prompt ids, None)``, or ``(ids or [], error completion)`` when the prompt cannot be rendered (a
        template failure concerns this request only) or prompt + ``max_tokens`` exceed ``context_tokens``."""
        try:
            ids = self.prompt_ids(request.messages)
        except Exception as e:  # noqa: BLE001
            return [], Completion("", "error", error=f"[request {request.request_id}] {e}")
        if context_tokens and len(ids) + request.max_tokens > context_tokens:
            return ids, Completion(
                "", "error", usage=Usage(len(ids), 0),
                error=f"[request {request.request_id}] prompt {len(ids)} + max_tokens {request.max_tokens} tokens exceed "
                f"the context window of {context_tokens} tokens",
            )
        return ids, None

    def _completion(self, request: Request, prompt: list[int], row: list[int], seconds: float) -> Completion:
        stops = set(self.stop_ids)
        limit = min(len(row), request.max_tokens)
        end = next((k for k in range(limit) if row[k] in stops), None)
        if end is not None:
            token_ids, finish, text_ids = row[: end + 1], "stop", row[:end]
        else:
            token_ids, finish, text_ids = row[:limit], "length", row[:limit]
        text = self.hf_tokenizer.decode(text_ids, skip_special_tokens=True)
        return Completion(
            text=text,
            finish_reason=finish,
            usage=Usage(len(prompt), len(token_ids)),
            token_ids=tuple(token_ids),
            prompt_token_ids=tuple(prompt),
            seconds=seconds,
        )


class HFBackend(ChatTokens):
    """A transformers causal LM behind the Backend protocol.

    Args:
        model: a loaded ``PreTrainedModel`` (shared, not copied: training updates are seen by the next
            rollout) or a path (HF directory or ``.gguf`` file, see :func:`load_hf_model`).
        tokenizer: the transformers (fast) tokenizer; required when ``model`` is an object, loaded with the
            model when it is a path.
        dtype: weights dtype when loading from a path (``"bfloat16"`` or ``"float32"``); a model object is
            used as it is.
        max_batch_size: most requests per ``generate`` call.
        context_tokens: context window; default the model's ``max_position_embeddings``.
        seed: base seed for sampling; each batch is seeded from it and its requests' seeds and ids, so the
            same batch samples the same tokens again (the global torch RNG is left untouched). Sampled (not
            greedy) answers therefore depend on which requests share a batch (``batch_size``, a resumed run),
            unlike llamacpp-batch and vllm, which seed each request; greedy answers do not.

    Raises:
        ConfigError: no tokenizer, or the tokenizer has no chat template.
    """

    batched = True

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        dtype: str = "bfloat16",
        max_batch_size: int = 8,
        context_tokens: int | None = None,
        seed: int = 0,
    ):
        name = "model"
        self.model_path: str | None = None  # the folder or .gguf loaded (its files' hash identifies the weights)
        if model is None:
            raise ConfigError("hf backend: give the model (an HF model folder or a .gguf file; --model, or model: in "
                              "a grid's backend)")
        if isinstance(model, (str, os.PathLike)):
            self.model_path = os.path.abspath(os.path.expanduser(os.fspath(model)))
            name = os.path.basename(self.model_path.rstrip("/"))
            model, loaded_tok = load_hf_model(model, dtype)
            tokenizer = tokenizer or loaded_tok
        if tokenizer is None:
            raise ConfigError("HFBackend needs the model's tokenizer when given a model object: pass tokenizer=")
        if isinstance(tokenizer, str):
            raise ConfigError(f"hf backend: tokenizer {tokenizer!r} is a name; the hf backend uses the model folder's "
                              "own tokenizer (leave tokenizer out of backend:, or give a loaded tokenizer from Python)")
        for knob, value in (("max_batch_size", max_batch_size), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"hf backend: {knob} must be a whole number, got {value!r}")
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.max_batch_size = max_batch_size
        positions = getattr(model.config, "max_position_embeddings", None)
        self.context_tokens = check_context_tokens(context_tokens, "hf") or positions
        if isinstance(positions, int) and self.context_tokens > positions:
            warnings.warn(f"hf backend: a window of {self.context_tokens} tokens (--n-ctx) is larger than the model's "
                          f"{positions} positions (max_position_embeddings); prompts past them are out of its training "
                          "range", stacklevel=2)
        self.seed = seed
        self.name = f"hf:{name}"
        ChatTokens.__init__(self, tokenizer, name, getattr(model.generation_config, "eos_token_id", None))

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Generate one completion per request (request order); see the module docstring for token ids.

        Raises:
            ConfigError: a request no backend can serve (:func:`memagent.backends.base.check_request`).
        """
        for r in requests:
            check_request(r)
        out: list[Completion | None] = [None] * len(requests)
        todo: dict[tuple, list[tuple[int, list[int]]]] = {}
        options = [engine_options(r, "hf") for r in requests]  # refused before anything runs
        for i, r in enumerate(requests):
            ids, err = self.prompt_or_error(r, self.context_tokens)
            if err is not None:
                out[i] = err
                continue
            # one generate call runs every row to the call's max_new_tokens: requests of another max_tokens (the
            # agent's memory updates beside final answers) go in another call, or a row would run past its own
            # budget, wasting compute and, on a model of learned positions (GPT-2), past the window (IndexError)
            key = (float(r.temperature), float(r.top_p) if r.temperature > 0 else 1.0, int(r.max_tokens),
                   tuple(sorted(options[i].items())))
            todo.setdefault(key, []).append((i, ids))
        for (temperature, top_p, _, extra), items in todo.items():
            for s in range(0, len(items), self.max_batch_size):
                part = items[s : s + self.max_batch_size]
                reqs = [requests[i] for i, _ in part]
                try:
                    comps = self._generate_batch(reqs, [ids for _, ids in part], temperature, top_p, dict(extra))
                except Exception as e:  # noqa: BLE001 - reported per request, never raised for one batch
                    comps = [Completion("", "error", error=f"[request {r.request_id}] {type(e).__name__}: {e}") for r in reqs]
                for (i, _), c in zip(part, comps):
                    out[i] = c
        return [c for c in out if c is not None]

    def _batch_seed(self, requests: Sequence[Request]) -> int:
        return request_seed(self.seed, requests)

    def _generate_batch(
        self, requests: Sequence[Request], prompts: list[list[int]], temperature: float, top_p: float,
        extra: dict[str, Any] | None = None,
    ) -> list[Completion]:
        import torch
        from transformers import GenerationConfig

        t0 = time.perf_counter()
        width = max(len(p) for p in prompts)
        device = next(self.model.parameters()).device
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: generation continues from the last column
            ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p) :] = 1
        max_new = max(r.max_tokens for r in requests)
        sample = temperature > 0
        # Only the request's temperature, top_p and extra sampling settings shape the distribution (training
        # rollouts send no extra ones: the training log-probs assume plain temperature/top-p sampling): top_k=0
        # turns off transformers' global default of 50, and the model's own generation config (e.g. top_k 20
        # and repetition_penalty 1.05 in Qwen2.5's) is set aside for the call, since generate() would fill
        # every field left unset here from it.
        cfg = GenerationConfig(
            max_new_tokens=max_new, do_sample=sample, temperature=temperature if sample else None,
            top_p=top_p if sample else None, top_k=0 if sample else None,  # greedy: no sampling flag (transformers warns)
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            bos_token_id=None, **(extra or {}),
        )
        was_training, own = self.model.training, self.model.generation_config
        self.model.eval()
        self.model.generation_config = GenerationConfig()
        try:
            # torch.manual_seed seeds every CUDA device too: fork (and so restore) their generators as well
            cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                torch.manual_seed(self._batch_seed(requests))
                gen = self.model.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg
                )
        finally:
            self.model.generation_config = own
            self.model.train(was_training)
        new = gen[:, width:].tolist()
        seconds = (time.perf_counter() - t0) / len(requests)
        return [self._completion(r, p, row, seconds) for r, p, row in zip(requests, prompts, new)]

    def close(self) -> None:
        """Nothing to release (the model may be shared with a trainer)."""
