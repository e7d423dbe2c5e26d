"""The questions a training run learns from and is validated on, and which of them each step takes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random

from memagent.errors import DataError
from memagent.train.config import TrainConfig


def samples_sha256(samples) -> str:
    """sha256 of the training questions as read (id, question, context, answers, in order): the identity of the
    data a checkpoint was trained on, independent of the path it was read from. Checked on resume."""
    digest = hashlib.sha256()
    for s in samples:
        context = s.context if isinstance(s.context, str) else repr(s.context)
        digest.update(json.dumps([s.id, s.question, context, list(s.answers)]).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def check_gold(samples, where: str) -> None:
    """Refuse, before any step, samples without a non-blank gold answer: their reward cannot be computed.

    Raises:
        DataError: naming the file and the first ids.
    """
    missing = [s.id for s in samples if not s.has_gold_answer]
    if missing:
        raise DataError(f"{len(missing)} of {len(samples)} samples in {where} have no gold answers (ids "
                        f"{', '.join(map(repr, missing[:5]))}{', ...' if len(missing) > 5 else ''}); the reward needs "
                        "them: add answers or drop those samples")


def _resolve(path: str, key: str) -> str:
    """``path`` as given, else under the data root; the error names the setting and where it looked (without a
    data root it spoke only of that, with ``--data-root``, a flag ``memagent train`` does not have)."""
    if os.path.exists(path):
        return path
    from memagent.data.paths import ENV_VAR, data_root

    here = f"{key} {path!r} not found (working directory {os.getcwd()!r})"
    if os.path.isabs(path):
        raise DataError(here)
    try:
        root = data_root()
    except DataError:
        env = os.environ.get(ENV_VAR)  # set to what is not a folder: say so, not that none was found
        why = f"${ENV_VAR} is {env!r}, which is not a folder" if env else f"none was found (${ENV_VAR})"
        raise DataError(f"{here}; a relative path is also looked for under the data root, and {why}") from None
    if not (root / path).exists():
        raise DataError(f"{here}, nor under the data root {str(root)!r}")
    return os.fspath(root / path)


def train_data(cfg: TrainConfig) -> list:
    """The training questions: ``data.train_path``, else generated needle questions.

    Raises:
        DataError: the file holds no samples.
    """
    d = cfg.data
    if d.train_path:
        from memagent.data.io import read_samples

        samples = read_samples(_resolve(d.train_path, "data.train_path"))
        if not samples:
            raise DataError(f"data.train_path {d.train_path} holds no samples")
        return samples
    from memagent.train.synthetic import needle_samples

    return needle_samples(d.synthetic_train_size, d.synthetic_context_words, cfg.run.seed, "train")


def val_data(cfg: TrainConfig) -> dict[int, list]:
    """Validation questions per length multiplier (``{1: samples}`` for a ``data.val_path`` file); none when
    ``run.val_every`` is 0 (validation off: a configured ``data.val_path`` is then not read and need not exist).

    Raises:
        DataError: the file holds no samples.
    """
    d = cfg.data
    if not cfg.run.val_every:
        return {}
    if d.val_path:
        from memagent.data.io import read_samples

        samples = read_samples(_resolve(d.val_path, "data.val_path"), limit=d.val_size)
        if not samples:
            raise DataError(f"data.val_path {d.val_path} holds no samples")
        return {1: samples}
    if d.synthetic is None:
        return {}
    if d.train_path:
        import warnings

        warnings.warn(f"training on {d.train_path} but validating on synthetic {d.synthetic} questions; set "
                      "data.val_path to validate on your own data (or data.synthetic=null for none)", stacklevel=2)
    from memagent.train.synthetic import needle_samples

    n = min(d.synthetic_val_size, d.val_size)
    return {m: needle_samples(n, d.synthetic_context_words * m, cfg.run.seed + 1, f"val{m}x")
            for m in d.val_context_multipliers}


def step_samples(samples: list, cfg: TrainConfig, position: int, rank: int, world_size: int) -> tuple[list, int]:
    """This process's questions for the step whose first question is the ``position``-th of the data stream,
    and the global index of its first one.

    Questions are taken in data order (reshuffled per epoch when ``data.shuffle``); process ``r`` of ``W``
    takes the ``r``-th contiguous block of ``prompts_per_step / W``. ``position`` is ``step x prompts_per_step``
    unless a resumed run changed ``rl.prompts_per_step``: then it continues from the checkpoint's
    ``data_position``, so no question is drawn twice in one epoch. With ``data.shuffle`` a step that crosses an
    epoch boundary can meet a question of the previous epoch's tail again at the head of the next: that copy
    gets the id ``"{id}@epoch{E}"`` (its own group and sampling seeds; the rollouts refuse duplicate ids).
    """
    n, per = len(samples), cfg.rl.prompts_per_step
    local = per // world_size
    first = position + rank * local
    out, ids = [], set()
    for g in range(first, first + local):
        epoch, pos = divmod(g, n)
        order = list(range(n))
        if cfg.data.shuffle:
            random.Random(f"{cfg.run.seed}/epoch{epoch}").shuffle(order)
        s = samples[order[pos]]
        if s.id in ids:  # a step across an epoch boundary met a question again (reshuffled): its own group, own id
            s = dataclasses.replace(s, id=f"{s.id}@epoch{epoch}")
        ids.add(s.id)
        out.append(s)
    return out, first
