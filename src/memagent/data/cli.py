"""`memagent data hotpotqa | ruler | ruler-train`: build benchmark data files (mounted by the main CLI as ``data``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from memagent.configtypes import parse_ints
from memagent.errors import ConfigError, MemagentError
from memagent.runfiles import first_missing, folder_problem, remove_created
from memagent.tokenization import load_tokenizer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Build benchmark data (RULER-HotpotQA, RULER tasks).")

TOKENIZER = typer.Option(
    "smollm2",
    "--tokenizer",
    help="'smollm2' (the embedded model's GGUF vocabulary), 'bytes', a .gguf file, a tokenizer.json or an HF model dir",
)
DATA_ROOT = typer.Option(None, "--data-root", help="data folder (default: $MEMAGENT_DATA, else ../shared/data)")


def _check_out(out: Path) -> None:
    problem = folder_problem(out)
    if problem:
        raise ConfigError(f"--out {str(out)!r} {problem}: give a folder (it is created when missing)")


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg="red", err=True)
    raise typer.Exit(2)


@app.command("hotpotqa")
def hotpotqa_command(
    out: Path = typer.Option(Path("runs/data/hotpotqa"), "--out", "-o", help="output folder"),
    docs: Optional[str] = typer.Option(None, "--docs", help="numbers of documents, e.g. 50,100,200 (the paper: 50..25600)"),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="target context lengths in tokens instead, e.g. 8K,32K"),
    samples: int = typer.Option(128, "--samples", "-n", help="questions per size"),
    seed: int = typer.Option(0, "--seed", help="base seed; each sample's RNG comes from (seed, question id)"),
    split: str = typer.Option("dev", "--split", help="dev or train"),
    start: int = typer.Option(0, "--start", help="first position in the split's file (records before it are skipped)"),
    allow_reuse: bool = typer.Option(False, "--allow-reuse", help="reuse distractors when the pool is too small"),
    reference_format: bool = typer.Option(False, "--reference-format", help="also write the reference's eval_{N}.json"),
    keep_incomplete: bool = typer.Option(False, "--keep-incomplete",
                                         help="keep questions whose context lacks a supporting paragraph (skipped by default)"),
    tokenizer: str = TOKENIZER,
    data_root: Optional[Path] = DATA_ROOT,
):
    """RULER-HotpotQA: each question's paragraphs hidden among distractor paragraphs, N documents or T tokens."""
    from memagent.data.hotpotqa import build_hotpotqa

    created = first_missing(out)
    try:
        if split not in ("dev", "train"):
            raise ConfigError(f"--split must be dev or train, got {split!r}")
        _check_out(out)
        if start < 0 or samples < 1:
            raise ConfigError(f"need --start >= 0 and --samples >= 1, got --start {start} --samples {samples}")
        files = build_hotpotqa(
            out, load_tokenizer(tokenizer), num_docs=parse_ints(docs, "--docs", suffix=False), target_tokens=parse_ints(tokens, "--tokens"),
            num_samples=samples, seed=seed, split=split, data_root=data_root, allow_reuse=allow_reuse, start=start,
            reference_format=reference_format, keep_incomplete=keep_incomplete,
        )
    except MemagentError as e:
        remove_created(out, created)  # the folders this build made, where nothing was written
        _fail(e)
    for f in files:
        typer.echo(str(f))


@app.command("ruler")
def ruler_command(
    task: str = typer.Option(..., "--task", "-t", help="comma-separated tasks, 'all' (13 RULER tasks) or 'memagent' (its 11)"),
    lengths: str = typer.Option("8192", "--lengths", "-l", help="target lengths in tokens, e.g. 8192,16384 or 8K,16K"),
    out: Path = typer.Option(Path("runs/data/ruler"), "--out", "-o", help="output folder"),
    samples: int = typer.Option(128, "--samples", "-n", help="samples per task and length"),
    seed: int = typer.Option(42, "--seed", help="base seed; each sample's RNG comes from (seed, task, length, index)"),
    haystack: Optional[str] = typer.Option(None, "--haystack", help="gutenberg: replace the essay haystack (licence-clean)"),
    tokenizer: str = TOKENIZER,
    data_root: Optional[Path] = DATA_ROOT,
):
    """RULER tasks fitted to token lengths; writes our schema, RULER's JSONL and a manifest per file."""
    from memagent.data.ruler import ALL_TASKS, MEMAGENT_TASKS
    from memagent.data.ruler.build import build_ruler

    names = {"all": list(ALL_TASKS), "memagent": list(MEMAGENT_TASKS)}.get(task) or list(
        dict.fromkeys(t.strip() for t in task.split(",") if t.strip()))
    created = first_missing(out)
    try:
        if not names:
            raise ConfigError(f"--task: name at least one task, 'all' or 'memagent' (tasks: {', '.join(ALL_TASKS)})")
        length_list = parse_ints(lengths, "--lengths")
        if not length_list:
            raise ConfigError("--lengths: give at least one target length in tokens, e.g. 8192,16384 or 8K,16K")
        if haystack not in (None, "essay", "gutenberg"):
            raise ConfigError(f"--haystack must be essay (the default) or gutenberg, got {haystack!r}")
        if samples < 1:
            raise ConfigError(f"--samples must be >= 1, got {samples}")
        _check_out(out)
        files = build_ruler(
            out, names, length_list, load_tokenizer(tokenizer), num_samples=samples, seed=seed,
            haystack=haystack, data_root=data_root,
        )
    except MemagentError as e:
        remove_created(out, created)  # the folders this build made, where nothing was written
        _fail(e)
    for f in files:
        typer.echo(str(f))


@app.command("ruler-train")
def ruler_train_command(
    task: str = typer.Option("niah_single_2,niah_multikey_1", "--task", "-t", help="comma-separated niah tasks and/or vt, cycled over the samples"),
    lengths: str = typer.Option("1K,1536,2K", "--lengths", "-l", help="target lengths in tokens, one drawn per sample"),
    out: Path = typer.Option(Path("runs/data/ruler_train.jsonl"), "--out", "-o", help="output JSONL file"),
    samples: int = typer.Option(512, "--samples", "-n", help="number of samples"),
    seed: int = typer.Option(1, "--seed", help="base seed (evaluation data uses 42); sample i depends only on (seed, i)"),
    haystack: str = typer.Option("gutenberg", "--haystack", help="prose haystack: gutenberg (not the evaluation's essays) or essay"),
    min_depth: int = typer.Option(0, "--min-depth", help="niah tasks: every needle at least this deep, in percent of the context (0: RULER's depths)"),
    distractors_before: int = typer.Option(0, "--distractors-before", help="niah_multikey_1: at least this many other keys' needles before the asked one (0: RULER's order)"),
    distractors_after: int = typer.Option(0, "--distractors-after", help="niah_multikey_1: at least this many other keys' needles after the asked one (0: RULER's order)"),
    tokenizer: str = TOKENIZER,
    data_root: Optional[Path] = DATA_ROOT,
):
    """Fresh RULER-family training samples (new draws, Gutenberg haystack from random starts): never the eval data."""
    from memagent.data.io import write_samples
    from memagent.data.ruler.train import build_training_set
    from memagent.data.schema import token_stats, write_manifest

    try:
        names = [t.strip() for t in task.split(",") if t.strip()]
        length_list = parse_ints(lengths, "--lengths")
        if haystack not in ("essay", "gutenberg"):
            raise ConfigError(f"--haystack must be gutenberg or essay, got {haystack!r}")
        if out.exists() and out.is_dir():
            raise ConfigError(f"--out {str(out)!r} is a folder: give a .jsonl file path")
        tok = load_tokenizer(tokenizer)
        built = build_training_set(names, length_list, samples, tok, seed=seed, haystack=haystack,
                                   data_root=None if data_root is None else str(data_root), min_depth=min_depth,
                                   distractors_before=distractors_before, distractors_after=distractors_after)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_samples(out, built)
        write_manifest(out.with_suffix(".manifest.json"), {
            "builder": "memagent data ruler-train", "tasks": names, "lengths_tokens": length_list,
            "num_samples": len(built), "seed": seed, "haystack": haystack, "min_depth": min_depth,
            "distractors_before": distractors_before, "distractors_after": distractors_after, "tokenizer": tok.name,
            "input_tokens": token_stats([s.metadata["length_tokens"] for s in built]),
        })
    except MemagentError as e:
        _fail(e)
    typer.echo(str(out))
