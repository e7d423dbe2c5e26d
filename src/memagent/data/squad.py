"""SQuAD 2.0 (dev) as a question source and paragraph pool for RULER's qa_1.

RULER keeps the answerable questions in file order; every unique paragraph of the file is a distractor, and
a question's own article supplies the first distractors (ruler-tasks.md). The local copy holds 16 of the 35 dev
articles; the paragraphs of the other 19 (``squad_v2_extra_paragraphs_cs224n_test_half.jsonl``, no questions)
are added to the pool when present, so the pool is 646 + 570 paragraphs (about 190K tokens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from memagent.data import paths
from memagent.data.documents import DocumentPool
from memagent.errors import DataError


@dataclass(frozen=True)
class SquadQuestion:
    """One answerable SQuAD question: id, question, distinct answer texts, article title, own paragraph."""

    id: str
    question: str
    answers: tuple[str, ...]
    title: str
    paragraph: str


def load_squad(path: str | os.PathLike) -> tuple[list[SquadQuestion], dict[str, list[str]]]:
    """Answerable questions in file order, and the paragraphs of every article (by title).

    Raises:
        DataError: the file is missing or not in the official SQuAD JSON layout.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"SQuAD file {str(p)!r} not found")
    with open(p, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "data" not in data:
        raise DataError(f"{p}: not a SQuAD JSON file (no top-level 'data')")
    questions, articles = [], {}
    for art in data["data"]:
        paras = [para["context"] for para in art["paragraphs"]]
        articles[art["title"]] = paras
        for para in art["paragraphs"]:
            for qa in para["qas"]:
                if qa.get("is_impossible"):
                    continue
                answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                if answers:
                    questions.append(SquadQuestion(qa["id"], qa["question"], answers, art["title"], para["context"]))
    return questions, articles


def squad_pool(articles: dict[str, list[str]], data_root: str | os.PathLike | None = None) -> DocumentPool:
    """All unique paragraphs of the dev file plus the extra paragraphs file when it exists."""
    texts = [t for paras in articles.values() for t in paras]
    try:
        extra = paths.data_file(paths.SQUAD_EXTRA_PARAGRAPHS, data_root)
    except DataError:
        extra = None
    if extra is not None:
        with open(extra, encoding="utf-8") as f:
            texts += [json.loads(line)["context"] for line in f if line.strip()]
    return DocumentPool.from_texts(texts, name="squad-v2-dev")
