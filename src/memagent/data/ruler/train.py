"""Training data of the RULER families, made fresh: never the evaluation samples.

``build_training_set`` mixes tasks and lengths: sample ``i`` is task ``tasks[i % len(tasks)]`` at a length drawn
from ``lengths``. What keeps it apart from the evaluation data built by ``memagent data ruler`` /
``memagent eval``:

- its own seed and sample keys (``train/<task>/<i>``), so needles, keys, values and depths are new draws;
- a different haystack for the prose tasks: Project Gutenberg novels (``gutenberg``) instead of the essays RULER
  evaluates on, each sample starting at a random word of the novels instead of at the first, so training
  documents are not all the same opening pages;
- vt keeps RULER's noise-line haystack (the task has no other), so only the chains and values differ.

Keys and values come from the same word lists and number ranges as RULER's, so they may coincide with an
evaluation sample's by chance (a 7-digit value: 1 in 9 million); the documents never do.

Source: issue 15 (training data); RULER task definitions in ruler-tasks.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from memagent.data.documents import sample_rng
from memagent.data.ruler import ALL_TASKS, build_ruler_sample
from memagent.data.ruler.common import haystack_text
from memagent.data.ruler.niah import NIAH_TASKS, build_niah
from memagent.errors import DataError
from memagent.tokenization import Tokenizer
from memagent.types import Sample


def build_training_set(
    tasks: Sequence[str],
    lengths: Sequence[int],
    num_samples: int,
    tokenizer: Tokenizer,
    seed: int = 1,
    haystack: str = "gutenberg",
    data_root: str | None = None,
    min_depth: int = 0,
    distractors_before: int = 0,
    distractors_after: int = 0,
) -> list[Sample]:
    """``num_samples`` training samples cycling over ``tasks``, each at a length drawn from ``lengths``.

    Args:
        tasks: RULER task names (niah variants and vt); ``cwe``/``fwe``/``qa`` are refused (their data is the
            evaluation data's source).
        lengths: target lengths in tokens (RULER input + tokens to generate), drawn uniformly per sample.
        num_samples: how many samples.
        tokenizer: the model's tokenizer (lengths are exact in it).
        seed: base seed; sample ``i`` depends only on ``(seed, i)``.
        haystack: prose haystack of the essay-based niah tasks: ``gutenberg`` (default, not the evaluation's) or
            ``essay``.
        data_root: explicit data root.
        min_depth: niah tasks: every needle at least this deep, in percent of the context
            (:func:`memagent.data.ruler.niah.build_niah`): with 35 and documents of 1.5-3K tokens a 512-token first
            chunk held the needle in 7 of 200 samples (about a third at 0), so a value written before the needle
            is read rarely earns the reward. 0: RULER's depths.
        distractors_before: tasks with distractor keys (niah_multikey_1): at least this many other keys' needles
            come before the asked one (:func:`memagent.data.ruler.niah.build_niah`), so a policy that keeps the
            first needle it reads earns nothing; the other tasks of the set are built as usual (their metadata
            records 0). The step-16 policy kept the first needle in most of its wrong niah_multikey_1 answers
            (docs/results/ruler_rl/README.md). 0: RULER's order.
        distractors_after: the same, other keys' needles after the asked one, so a policy that lets each new
            needle overwrite the memory earns nothing (the step-22 policy lost a captured value that way).

    Returns:
        Samples with ids ``train-<task>-<length>-<i>``; ``metadata`` also records ``split: train`` and
        ``start_word`` (where the prose haystack begins).

    Raises:
        DataError: an unsupported task, no lengths, ``min_depth`` with vt (its chain has no depth setting), or a
            sample that cannot be built.
    """
    _check_request(tasks, lengths, num_samples, min_depth, distractors_before, distractors_after)
    words = len(haystack_text(haystack, data_root).split(" ")) if haystack else 0
    out = []
    for i in range(num_samples):
        task = tasks[i % len(tasks)]
        rng = sample_rng(seed, f"train/{task}/{i}")
        length = lengths[rng.randrange(len(lengths))]
        before = after = 0
        if task in NIAH_TASKS:
            cfg = NIAH_TASKS[task]
            start = rng.randrange(words) if cfg.haystack == "essay" else None
            if cfg.num_keys > cfg.num_queries:
                before, after = distractors_before, distractors_after
            s = build_niah(task, length, i, tokenizer, seed=seed, haystack=haystack, data_root=data_root,
                           start_word=start or 0, min_depth=min_depth, distractors_before=before,
                           distractors_after=after)
        else:
            start = None
            s = build_ruler_sample(task, length, i, tokenizer, seed=seed, data_root=data_root)
        meta = {**s.metadata, "split": "train", "start_word": start, "min_depth": min_depth}
        if distractors_before:
            meta["distractors_before"] = before
        if distractors_after:
            meta["distractors_after"] = after
        out.append(replace(s, id=f"train-{s.id}", metadata=meta))
    return out


def _check_request(tasks: Sequence[str], lengths: Sequence[int], num_samples: int, min_depth: int,
                   distractors_before: int, distractors_after: int) -> None:
    """The checks of :func:`build_training_set`'s arguments, before anything is built.

    Raises:
        DataError: as listed there."""
    allowed = tuple(NIAH_TASKS) + ("vt",)
    bad = [t for t in tasks if t not in allowed]
    if bad:
        known = ", ".join(allowed)
        hint = "" if all(b in ALL_TASKS for b in bad) else " (not RULER task names)"
        raise DataError(f"training tasks {bad}{hint}: the training builder makes {known}")
    if not tasks or not lengths or num_samples < 1:
        raise DataError("build_training_set needs at least one task, one length and num_samples >= 1")
    order = distractors_before or distractors_after
    if order and not any(t in NIAH_TASKS and NIAH_TASKS[t].num_keys > NIAH_TASKS[t].num_queries for t in tasks):
        raise DataError(f"distractors_before={distractors_before}, distractors_after={distractors_after} apply to "
                        f"tasks with distractor keys (niah_multikey_1); none of {list(tasks)} has them")
    if min_depth and "vt" in tasks:
        raise DataError("min_depth applies to the niah tasks only: build vt samples in a separate file without it")
