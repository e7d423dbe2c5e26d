"""The sample contract: how a :class:`memagent.types.Sample` is written down, checked and converted.

One sample is one JSON object::

    {"id": str, "question": str, "context": str,
     "answers": [str, ...],            # optional, default []; "answer": str is read the same way
     "metadata": {...}}                # optional, default {}

Instead of ``context`` a record may give ``documents`` (a list of strings); they are rendered as numbered
documents (:func:`render_documents`), the layout of RULER's qa tasks and RULER-HotpotQA. Metadata keys that
the builders always set (readers do not require them):

- ``task``: task name (``hotpotqa``, ``niah_single_2``, ...);
- ``length_tokens``: length in tokens of ``tokenizer``: of ``context`` (RULER-HotpotQA), of RULER's whole
  input, instruction + context + question (RULER tasks, the length RULER fits);
- ``tokenizer``: the tokenizer's name;
- ``target_tokens`` / ``num_docs``: what the builder aimed at;
- ``source``: where the question came from (e.g. ``hotpotqa-dev:<dev_index>``);
- ``evidence``: where the answer sits in ``context`` (RULER needles, the vt chain, gold paragraphs), a list
  of ``{start_char, end_char, text, answer?, kind?}`` (:func:`evidence_item`; docs/diagnostics.md). User data
  may bring its own; :mod:`memagent.eval.diagnostics` reads it to find the chunk that holds the evidence.

Also here: converters from the reference's own record layouts (reference doc section 3.5) and from Hugging
Face ``datasets`` rows, each returning a Sample or raising :class:`DataError` naming where and which field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from memagent.errors import DataError
from memagent.tokenization import lone_surrogate  # noqa: F401 - its home is tokenization; re-exported
from memagent.types import Sample

SAMPLE_FIELDS = ("id", "question", "context", "answers", "metadata")


def check_unicode(obj: Any, where: str) -> None:
    """Refuse a record that holds a lone surrogate in any string (values and keys, at any depth).

    Args:
        obj: a parsed JSON value.
        where: location for the error message (``file:line``).

    Raises:
        DataError: naming ``where``, the field, the code point and its character offset, and the fix.
    """
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            at = lone_surrogate(value)
            if at is not None:
                field = f"field {path!r}" if path else "the record"
                raise DataError(
                    f"{where}: {field} holds a lone surrogate U+{ord(value[at]):04X} at character {at}, which is not "
                    "a Unicode character (a JSON \\u escape between \\ud800 and \\udfff without its pair); no "
                    "tokenizer can encode it. Fix or drop that escape (a pair such as \\ud83d\\ude00 is fine)")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                key = str(k)
                if isinstance(k, str) and lone_surrogate(k) is not None:
                    todo.append((path, k))
                todo.append((f"{path}.{key}" if path else key, v))
        elif isinstance(value, (list, tuple)):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def render_documents(documents: Sequence[str]) -> str:
    """Numbered documents, ``Document 1:\\n<text>``, separated by blank lines.

    Source: reference doc section 3.2 (the RULER-HotpotQA layout; RULER's qa tasks use the same).
    """
    return "\n\n".join(f"Document {i}:\n{doc}" for i, doc in enumerate(documents, 1))


def document_spans(documents: Sequence[str]) -> list[tuple[int, int]]:
    """The ``[start_char, end_char)`` span of each document's own text (header excluded) inside
    ``render_documents(documents)``."""
    spans, pos = [], 0
    for i, doc in enumerate(documents, 1):
        start = pos + len(f"Document {i}:\n")
        spans.append((start, start + len(doc)))
        pos = start + len(doc) + 2  # the blank line between documents
    return spans


def joined_spans(parts: Sequence[str], sep: str, indices: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start_char, end_char)`` span of ``parts[i]`` inside ``sep.join(parts)`` for each ``i`` of
    ``indices`` (in the order given)."""
    starts, pos = [], 0
    for p in parts:
        starts.append(pos)
        pos += len(p) + len(sep)
    return [(starts[i], starts[i] + len(parts[i])) for i in indices]


def evidence_item(context: str, start_char: int, end_char: int, kind: str, answer: str | None = None, **extra: Any) -> dict[str, Any]:
    """One entry of ``metadata["evidence"]``: the span ``context[start_char:end_char]`` and its text.

    Args:
        context: the sample's context.
        start_char, end_char: the span in characters, ``[start, end)``.
        kind: what the span is (``needle``, ``assignment``, ``supporting_paragraph``, ``gold_paragraph``).
        answer: the gold answer this span states, when it states one (a needle's value, a vt variable name).
        extra: further JSON fields (e.g. ``key``, ``document``).
    """
    item: dict[str, Any] = {"start_char": start_char, "end_char": end_char, "text": context[start_char:end_char], "kind": kind}
    if answer is not None:
        item["answer"] = answer
    item.update(extra)
    return item


def _need(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{where}: field {key!r} must be {names}, got {type(val).__name__}")
    return val


def _answers(val: Any, where: str, key: str) -> tuple[str, ...]:
    if val is None:
        return ()
    if isinstance(val, str):
        return (val,)
    val = _pylist(val)  # numpy arrays from parquet
    if not isinstance(val, (list, tuple)) or not all(isinstance(a, str) for a in val):
        raise DataError(f"{where}: field {key!r} must be a string or a list of strings, got {val!r:.80}")
    return tuple(val)


def sample_from_dict(obj: Any, where: str = "<record>") -> Sample:
    """Check and convert one record of our schema.

    Args:
        obj: the parsed JSON object.
        where: location for error messages (``file:line``).

    Raises:
        DataError: not an object, an empty question, both ``answers`` and ``answer``, or a field is missing or
            has the wrong type (names ``where`` and the field).
    """
    if not isinstance(obj, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    sid = _need(obj, "id", (str, int), where)
    if isinstance(sid, bool) or not str(sid).strip():
        raise DataError(f"{where}: field 'id' must be a non-empty string or an integer, got {sid!r}")
    question = _need(obj, "question", str, where)
    if not question.strip():
        raise DataError(f"{where}: field 'question' is empty; every sample needs a question")
    if "context" in obj:
        context = _need(obj, "context", str, where)
    elif "documents" in obj:
        docs = _need(obj, "documents", list, where)
        if not all(isinstance(d, str) for d in docs):
            raise DataError(f"{where}: field 'documents' must be a list of strings")
        context = render_documents(docs)
    else:
        raise DataError(f"{where}: missing field 'context' (or 'documents')")
    if "answer" in obj and "answers" in obj:
        raise DataError(f"{where}: give the gold answers in one field, 'answers' (a list) or 'answer', not both")
    key = "answer" if "answer" in obj else "answers"  # 'answer': HotpotQA's and many datasets' own name
    answers = _answers(obj.get(key), where, key)
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = {}
    if isinstance(metadata, str):  # parquet stores metadata as JSON text
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise DataError(f"{where}: field 'metadata' is text but not a JSON object") from None
    if not isinstance(metadata, Mapping):
        raise DataError(f"{where}: field 'metadata' must be an object")
    return Sample(str(sid), question, context, answers, dict(metadata))


def sample_to_dict(sample: Sample) -> dict[str, Any]:
    """The JSON object of a sample (our schema)."""
    return sample.to_dict()


def _context_text(obj: Mapping[str, Any], where: str) -> str:
    ctx = obj.get("context")
    if isinstance(ctx, str):
        return ctx
    if isinstance(ctx, list):
        raise DataError(
            f"{where}: field 'context' holds document indices into the reference's full HotpotQA/SQuAD pool "
            "(its files above ~1M tokens); that pool is not available here. Rebuild such lengths with "
            "`memagent data hotpotqa` or `memagent data ruler` instead."
        )
    if "input" in obj and "outputs" in obj:  # RULER's own JSONL: the whole prompt in one field, no question
        raise DataError(f"{where}: this is RULER's JSONL (input, outputs), which has no separate question and "
                        "context; read the file `memagent data ruler` wrote beside it ({task}_{length}.jsonl, "
                        "without .ruler), which is in memagent's schema")
    raise DataError(f"{where}: missing or non-string field 'context'")


def sample_from_reference(obj: Any, where: str = "<record>") -> Sample:
    """Convert a record of one of the reference's layouts (reference doc section 3.5).

    Recognised by their keys:

    - RULER-HotpotQA eval (``eval_{N}.json``): ``context, input, answers, num_docs, index``;
    - RULER OOD eval (``eval_{task}_{len}.json``): ``index, input, context, outputs, answer_prefix[, length]``;
    - training parquet rows: ``prompt`` (list of one user message), ``context``, ``reward_model.ground_truth``,
      ``extra_info.index``;
    - Hugging Face ``datasets`` rows of HotpotQA (``context: {title, sentences}``) and SQuAD
      (``answers: {text, answer_start}``), through :func:`sample_from_hf`;
    - official HotpotQA records (``_id``, ``question``, ``answer``, ``context: [[title, [sentence, ...]], ...]``):
      the paragraphs become numbered documents, as in :func:`sample_from_hf`;
    - our own schema (``id, question, context``).

    Raises:
        DataError: the record matches none of the layouts or a field is malformed.
    """
    if not isinstance(obj, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ctx = obj.get("context")
    if ("question" in obj and ((isinstance(ctx, Mapping) and "title" in ctx and "sentences" in ctx)
                               or (isinstance(ctx, str) and isinstance(obj.get("answers"), Mapping)))):
        return _from_hf_row(obj, where)
    if "_id" in obj and "id" not in obj and "question" in obj and isinstance(ctx, list):  # official HotpotQA
        pairs = ctx
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
                   and all(isinstance(x, str) for x in p[1]) for p in pairs):
            raise DataError(f"{where}: field 'context' of a HotpotQA record must be [[title, [sentence, ...]], ...]")
        row = {**obj, "id": obj["_id"], "context": {"title": [t for t, _ in pairs], "sentences": [x for _, x in pairs]}}
        return _from_hf_row(row, where)
    if "id" in obj or "question" in obj:
        return sample_from_dict(obj, where)
    if "reward_model" in obj and "prompt" in obj:
        return _from_train_row(obj, where)
    if "input" in obj and ("answers" in obj or "outputs" in obj):
        key = "answers" if "answers" in obj else "outputs"
        meta = {k: obj[k] for k in ("num_docs", "answer_prefix", "length", "index") if k in obj}
        if "length" in meta:
            meta["reference_length_tokens"] = meta.pop("length")
        sid = obj.get("index", obj.get("_id"))
        if sid is None:
            raise DataError(f"{where}: missing field 'index'")
        question = _need(obj, "input", str, where)
        return Sample(str(sid), question, _context_text(obj, where), _answers(obj[key], where, key), meta)
    raise DataError(
        f"{where}: unknown record layout (keys: {', '.join(sorted(obj))}); expected our schema "
        "(id, question, context) or a reference eval/training record"
    )


def _from_hf_row(obj: Mapping[str, Any], where: str) -> Sample:
    """:func:`sample_from_hf` with its fields checked: a DataError naming ``where`` and the field, never a
    KeyError or TypeError (parquet's numpy arrays are taken as lists)."""
    sid = obj.get("id", obj.get("_id"))
    if sid is None or isinstance(sid, bool) or not isinstance(sid, (str, int)) or not str(sid).strip():
        raise DataError(f"{where}: missing field 'id' (a non-empty string or an integer)")
    question = _need(obj, "question", str, where)
    if not question.strip():
        raise DataError(f"{where}: field 'question' is empty; every sample needs a question")
    ctx = obj["context"]
    if isinstance(ctx, Mapping):
        titles, sents = _pylist(ctx.get("title")), _pylist(ctx.get("sentences"))
        sents = [_pylist(x) for x in sents] if isinstance(sents, list) else sents
        if (not isinstance(titles, list) or not isinstance(sents, list) or len(titles) != len(sents)
                or not all(isinstance(t, str) for t in titles)
                or not all(isinstance(x, list) and all(isinstance(y, str) for y in x) for x in sents)):
            raise DataError(f"{where}: field 'context' must be {{title: [str, ...], sentences: [[str, ...], ...]}} "
                            "with one list of sentences per title")
        if not isinstance(obj.get("answer"), str):
            raise DataError(f"{where}: field 'answer' must be a string, got {obj.get('answer')!r}")
        obj = {**obj, "context": {"title": titles, "sentences": sents}}
    else:
        texts = _pylist(obj["answers"].get("text"))
        obj = {**obj, "answers": {**obj["answers"], "text": list(_answers(texts, where, "answers.text"))}}
    return sample_from_hf(obj, where)


def _pylist(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _from_train_row(obj: Mapping[str, Any], where: str) -> Sample:
    prompt = obj["prompt"]
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt or not isinstance(prompt[0], Mapping):
        raise DataError(f"{where}: field 'prompt' must be a list of chat messages")
    question = prompt[0].get("content")
    if not isinstance(question, str):
        raise DataError(f"{where}: field 'prompt[0].content' must be a string")
    rm = obj["reward_model"]
    if not isinstance(rm, Mapping) or "ground_truth" not in rm:
        raise DataError(f"{where}: field 'reward_model.ground_truth' is missing")
    extra = obj.get("extra_info") or {}
    sid = extra.get("index") if isinstance(extra, Mapping) else None
    if sid is None:
        raise DataError(f"{where}: field 'extra_info.index' is missing")
    meta = {"data_source": obj.get("data_source"), "num_docs": extra.get("num_docs")}
    answers = _answers(rm["ground_truth"], where, "reward_model.ground_truth")
    return Sample(str(sid), question, _context_text(obj, where), answers, {k: v for k, v in meta.items() if v is not None})


def sample_from_hf(row: Mapping[str, Any], where: str = "<row>") -> Sample:
    """Convert a Hugging Face ``datasets`` row of HotpotQA (distractor) or SQuAD v2.

    HotpotQA rows (``context = {title: [...], sentences: [[...], ...]}``) become numbered documents
    (``title\\n`` + joined sentences) with ``answers = [answer]``; SQuAD rows keep their paragraph as context
    and ``answers.text`` as answers (empty for unanswerable questions).

    Raises:
        DataError: neither layout.
    """
    ctx = row.get("context")
    if isinstance(ctx, Mapping) and "title" in ctx and "sentences" in ctx:
        docs = [f"{t}\n{''.join(s)}" for t, s in zip(ctx["title"], ctx["sentences"])]
        meta = {k: row[k] for k in ("type", "level") if k in row}
        meta["task"] = "hotpotqa"
        return Sample(str(row.get("id", row.get("_id"))), row["question"], render_documents(docs), (row["answer"],), meta)
    if isinstance(ctx, str) and isinstance(row.get("answers"), Mapping):
        texts = tuple(row["answers"].get("text") or ())
        return Sample(str(row["id"]), row["question"], ctx, texts, {"task": "squad", "title": row.get("title")})
    raise DataError(f"{where}: not a HotpotQA-distractor or SQuAD-v2 row (keys: {', '.join(sorted(row))})")


def write_manifest(path: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Write a build manifest (seed, tokenizer, pool, counts, token statistics) as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def token_stats(lengths: Sequence[int]) -> dict[str, float]:
    """``{n, mean, min, max}`` of per-sample token counts (empty input gives zeros)."""
    if not lengths:
        return {"n": 0, "mean": 0.0, "min": 0, "max": 0}
    return {"n": len(lengths), "mean": sum(lengths) / len(lengths), "min": min(lengths), "max": max(lengths)}
