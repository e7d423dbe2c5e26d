"""Write RULER task files: our sample schema, RULER's JSONL and a manifest per (task, length)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from memagent.data.documents import build_all
from memagent.data.io import write_records, write_samples
from memagent.data.ruler import RULER_METRIC, RULER_TASKS, build_ruler_sample
from memagent.data.ruler.common import ruler_record
from memagent.data.schema import token_stats, write_manifest
from memagent.errors import DataError
from memagent.processes import process_running
from memagent.tokenization import Tokenizer


def build_ruler(
    out_dir: str | os.PathLike,
    tasks: Sequence[str],
    lengths: Sequence[int],
    tokenizer: Tokenizer,
    num_samples: int = 128,
    seed: int = 42,
    haystack: str | None = None,
    data_root: str | os.PathLike | None = None,
) -> list[Path]:
    """Build ``num_samples`` samples for every task and length.

    Writes ``{task}_{length}.jsonl`` (our schema), ``{task}_{length}.ruler.jsonl`` (RULER's ``index, input,
    outputs, length`` records) and ``{task}_{length}.manifest.json`` (seed, tokenizer, counts, token
    statistics, seconds). Files are written into a staging folder inside ``out_dir`` and moved into place only
    when every (task, length) is built, so a length that cannot be built leaves no partial output (and memory
    stays bounded by one cell). The staging folders of earlier builds into ``out_dir`` that were killed are
    removed first (:func:`remove_stale_stages`).

    Returns:
        The sample files (our schema) written.

    Raises:
        UnknownNameError: an unknown task (checked before anything is built).
        DataError: a sample cannot be built.
    """
    for t in tasks:
        RULER_TASKS.get(t)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_stages(out)
    stage = out / f".building-{os.getpid()}"
    stage.mkdir(exist_ok=True)
    try:
        names = _build_into(stage, tasks, lengths, tokenizer, num_samples, seed, haystack, data_root)
        for f in sorted(stage.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [out / n for n in names]


def remove_stale_stages(out: Path) -> list[Path]:
    """Remove the staging folders (``.building-PID``) of builds into ``out`` that were killed (SIGKILL, a lost
    machine: their ``finally`` never ran), i.e. whose process no longer runs on this machine.

    A staging folder of a running build (another process writing into the same ``--out``) is kept. The check is
    by process id, so a folder on a disk shared with another machine whose build still runs there could be
    taken for stale only if this machine has no process of that id either; its files are only ever moved into
    place whole, so a removed stage costs that build an error, never a partial output.

    Returns:
        The folders removed.
    """
    removed = []
    for stage in out.glob(".building-*"):
        pid = stage.name.removeprefix(".building-")
        if not pid.isdigit() or not stage.is_dir() or process_running(int(pid)):
            continue
        shutil.rmtree(stage, ignore_errors=True)
        removed.append(stage)
    return removed




def _build_into(stage: Path, tasks, lengths, tokenizer, num_samples, seed, haystack, data_root) -> list[str]:
    out = stage
    root = None if data_root is None else str(data_root)
    written = []
    for task in tasks:
        for length in lengths:
            t0 = time.perf_counter()
            try:
                samples = build_all(range(num_samples),
                                    lambda i: build_ruler_sample(task, length, i, tokenizer, seed, haystack, root),
                                    lambda i: f"sample {i}", f"{length} tokens")
            except DataError as e:
                raise DataError(f"{task}: {e}") from None
            seconds = time.perf_counter() - t0
            path = out / f"{task}_{length}.jsonl"
            write_samples(path, samples)
            write_records(out / f"{task}_{length}.ruler.jsonl", (ruler_record(s) for s in samples))
            write_manifest(
                out / f"{task}_{length}.manifest.json",
                {
                    "task": task,
                    "length_tokens": length,
                    "tokens_to_generate": samples[0].metadata["tokens_to_generate"] if samples else None,
                    "num_samples": len(samples),
                    "seed": seed,
                    "tokenizer": tokenizer.name,
                    # what the samples used (a task whose haystack is noise or needles keeps it under --haystack)
                    "haystack": _haystacks(samples) or haystack,
                    "metric": RULER_METRIC[task],
                    "input_tokens": token_stats([s.metadata["length_tokens"] for s in samples]),
                    "build_seconds": round(seconds, 3),
                },
            )
            written.append(path.name)
    return written


def _haystacks(samples) -> str | None:
    """The haystack the samples record (``essay``, ``gutenberg``, ``noise`` ...; several joined by ``,``)."""
    kinds = sorted({str(s.metadata["haystack"]) for s in samples if s.metadata.get("haystack")})
    return ",".join(kinds) or None
