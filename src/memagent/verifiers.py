"""Verifiers: score a prediction against gold answers. Shared by evaluation and RL rewards.

Every verifier has the signature ``verifier(prediction: str, answers: Sequence[str]) -> float`` and returns a
score in ``[0, 1]``; :data:`VERIFIERS` maps names to them. Eval metrics and training rewards call the same
functions, so a reward is always a verifier's score.

Our defaults versus the reference (reference doc sections 2.6, 3.3, 4.9 and 6, item 5):

- Gold answers made only of articles and punctuation ("A", "The The", "a.") normalise to "", which would
  make them unmatchable (or, in the SQuAD script, matched by any prediction that also normalises to "").
  Against such a gold answer both sides are normalised without removing articles
  (:func:`normalize_keep_articles`), and sub-EM falls back to equality ("a" is inside most words).
- ``sub_em``: containment either way after normalisation, best over all gold answers. A prediction that
  normalises to the empty string scores 0: the empty string is contained in every string, so without this
  rule a prediction such as "The." would count as correct. ``sub_em_reference`` keeps the
  reference's behaviour: only ``answers[0]`` is used, a raw prediction that is empty scores 0, but one that
  normalises to "" (e.g. "the", "...") scores 1.
- ``strict_boxed``: the training reward. The content of the last ``\\boxed{}`` in the whole response must
  equal a gold answer after :func:`normalize_answer` (the same normalisation as the eval metrics).
  ``strict_boxed_reference`` reproduces the reference's training reward exactly, faults included (each listed
  in its docstring): only the last 300 characters of the response are searched, both sides are lower-cased
  and passed through a MATH-style ``strip_string`` that deletes every space (so "new york" equals "newyork")
  but keeps punctuation and articles, and ``\\fbox{Paris}`` or ``\\boxed{0.5}`` against ``.5`` score 0.
- ``f1``: SQuAD token F1 with the rule that a yes/no/noanswer answer must match exactly; best over answers
  (the reference scores against ``answers[0]`` only: ``f1_reference``).
- ``string_match_all`` / ``string_match_part``: RULER's metrics, per item in ``[0, 1]`` (RULER multiplies the
  mean by 100), on the prediction after RULER's clean-up (:func:`ruler_clean_prediction`: strip, control
  characters to newlines, strip).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

from memagent.registry import Registry

Verifier = Callable[[str, Sequence[str]], float]

VERIFIERS: Registry[Verifier] = Registry("verifier")

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str | None) -> str:
    """SQuAD answer normalisation.

    Unicode NFC first (``Cafe\u0301`` and ``Café`` are one answer; the SQuAD script compares code points, a fix
    here), then lower-case, delete ASCII punctuation, replace the whole words a/an/the by a space, collapse
    whitespace.

    Args:
        text: the raw answer (``None`` is treated as "").

    Returns:
        The normalised answer ("" for an empty or all-punctuation/article answer).

    Source: reference doc section 2.6 (``normalize_answer``), the SQuAD v1.1 evaluation script.
    """
    if not text:
        return ""
    text = unicodedata.normalize("NFC", text).lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_keep_articles(text: str | None) -> str:
    """:func:`normalize_answer` without removing a/an/the: lower-case, delete ASCII punctuation, collapse
    whitespace. Used for gold answers that consist of articles only (see the module docstring)."""
    if not text:
        return ""
    return " ".join(unicodedata.normalize("NFC", text).lower().translate(_PUNCTUATION).split())


def _normalized_pair(prediction: str | None, answer: str) -> tuple[str, str, bool]:
    """``(prediction, gold, articles_kept)`` normalised for comparison: by :func:`normalize_answer`, or by
    :func:`normalize_keep_articles` on both sides when the gold answer is made of articles only."""
    gold = normalize_answer(answer)
    if gold:
        return normalize_answer(prediction), gold, False
    return normalize_keep_articles(prediction), normalize_keep_articles(answer), True


def _as_list(answers: Sequence[str] | str) -> list[str]:
    if isinstance(answers, str):
        return [answers]
    return [a for a in answers if a is not None]


def _nonblank(answers: Sequence[str] | str) -> list[str]:
    """The gold strings that are not blank: a blank one is contained in every prediction, so the RULER matches
    (which count it as found, a reward floor for any answer) leave it out."""
    return [a for a in _as_list(answers) if a.strip()]


@VERIFIERS.register("exact_match")
def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer, else 0.0.

    An empty normalised prediction never matches (not even an empty gold answer); a gold answer made of
    articles only is compared with articles kept (``exact_match("a", ["A"]) == 1``).
    """
    for a in _as_list(answers):
        pred, gold, _ = _normalized_pair(prediction, a)
        if pred and pred == gold:
            return 1.0
    return 0.0


@VERIFIERS.register("sub_em")
def sub_em(prediction: str, answers: Sequence[str]) -> float:
    """Substring exact match, either way: gold in prediction or prediction in gold, after normalisation.

    Best over all gold answers. A prediction that normalises to "" scores 0 (see the module docstring for
    why, and :func:`sub_em_reference` for the reference's behaviour); a gold answer made of articles only
    ("A") must be equal, articles kept. Containment is of
    characters, as in the paper's metric, so a fragment scores too: ``sub_em("n", ["no"]) == 1`` and
    ``sub_em("1", ["1945"]) == 1``. Read it next to :func:`exact_match` and :func:`f1`, which the eval summary
    reports alongside.

    Source: reference doc section 2.6 (``sub_em``, the paper's reported "accuracy") and section 6 item 5.
    """
    for a in _as_list(answers):
        pred, gold, articles_only = _normalized_pair(prediction, a)
        if not pred or not gold:
            continue
        if pred == gold if articles_only else (gold in pred or pred in gold):
            return 1.0
    return 0.0


@VERIFIERS.register("sub_em_reference")
def sub_em_reference(prediction: str | None, answers: Sequence[str]) -> float:
    """The reference's ``sub_em``: only ``answers[0]``; an empty raw prediction scores 0, but a prediction
    that normalises to "" is contained in any gold answer and scores 1.

    Source: reference doc section 2.6; kept for comparing with published numbers.
    """
    golds = _as_list(answers)
    if not prediction or not prediction.strip() or not golds:
        return 0.0
    pred, gold = normalize_answer(prediction), normalize_answer(golds[0])
    return float(gold in pred or pred in gold)


def _f1_one(pred: str, gold: str) -> float:
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@VERIFIERS.register("f1")
def f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD token F1 between normalised strings, best over gold answers.

    If either side normalises to yes/no/noanswer and the two differ, F1 is 0. Empty predictions score 0; a
    gold answer made of articles only is compared with articles kept.

    Source: reference doc section 2.6 (``f1``), HotpotQA's evaluation script.
    """
    best = 0.0
    for a in _as_list(answers):
        pred, gold, _ = _normalized_pair(prediction, a)
        if pred and gold:
            best = max(best, _f1_one(pred, gold))
    return best


@VERIFIERS.register("f1_reference")
def f1_reference(prediction: str | None, answers: Sequence[str]) -> float:
    """The reference's F1: like :func:`f1` but against ``answers[0]`` only."""
    golds = _as_list(answers)
    if not prediction or not golds:
        return 0.0
    return _f1_one(normalize_answer(prediction), normalize_answer(golds[0]))


_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def ruler_clean_prediction(prediction: str | None) -> str:
    """RULER's clean-up of a prediction before string matching: strip surrounding whitespace, turn every
    control character (U+0000-U+001F, so tabs, carriage returns and newlines too) into a newline, strip again.

    It changes a score only where a gold string holds a control character or starts or ends with whitespace
    (prediction ``"a\\tb"`` no longer holds gold ``"a\\tb"``; ``"\\tParis\\x00"`` still holds ``"Paris"``); it
    also makes a prediction of only whitespace and control characters empty, which RULER counts as a null
    prediction (our ``n_empty``).

    Source: NVIDIA RULER ``scripts/eval/evaluate.py`` (``postprocess_pred``), applied to every prediction
    before ``string_match_all`` / ``string_match_part``; Unicode NFC is ours (gold strings get it too), so one
    text in two encodings matches.
    """
    return unicodedata.normalize("NFC", _CONTROL_CHARS.sub("\n", (prediction or "").strip()).strip())


@VERIFIERS.register("string_match_all")
def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER all-match: the share of gold strings found in the prediction (case-insensitive substring), after
    RULER's clean-up of the prediction (:func:`ruler_clean_prediction`).

    Blank gold strings are left out (RULER counts one as found in any prediction: ``["2345678", ""]`` gave
    ``"wrong"`` 0.5); with none left the score is 0.

    Source: NVIDIA RULER ``eval/synthetic/constants.py``; ruler-tasks.md (niah, vt, cwe, fwe).
    """
    golds = _nonblank(answers)
    if not golds:
        return 0.0
    pred = ruler_clean_prediction(prediction).lower()
    return sum(unicodedata.normalize("NFC", g).lower() in pred for g in golds) / len(golds)


@VERIFIERS.register("string_match_part")
def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER part-match: 1.0 if any gold string occurs in the prediction (case-insensitive substring), after
    RULER's clean-up of the prediction (:func:`ruler_clean_prediction`). Blank gold strings are left out, as in
    :func:`string_match_all`.

    Source: NVIDIA RULER ``eval/synthetic/constants.py``; ruler-tasks.md (qa tasks).
    """
    pred = ruler_clean_prediction(prediction).lower()
    return float(any(unicodedata.normalize("NFC", g).lower() in pred for g in _nonblank(answers)))


@VERIFIERS.register("strict_boxed")
def strict_boxed_reward(response: str, answers: Sequence[str]) -> float:
    """The strict training reward: the last ``\\boxed{...}`` of the response equals a gold answer.

    Equality is after :func:`normalize_answer`, with ``\\text{...}`` (``\\textbf``, ``\\mathrm``) unwrapped as
    :func:`memagent.answers.extract_answer` does (``\\boxed{\\text{Paris}}`` equals Paris; the reference scores it 0);
    a missing box or a box that normalises to "" scores 0. The whole response is searched (the reference looks
    only at its last 300 characters, see :func:`strict_boxed_reward_reference`).

    Args:
        response: the model's raw final response.
        answers: gold answers.

    Returns:
        1.0 or 0.0.

    Source: reference doc section 4.9 (binary, strict reward from the last boxed answer).
    """
    from memagent.answers import last_boxed, unwrap_text

    boxed = last_boxed(response or "")
    if boxed is None:
        return 0.0
    return exact_match(unwrap_text(boxed), answers)


# ----------------------------------------------------------------------------- reference compatibility

_REFERENCE_WINDOW_CHARS = 300


def reference_last_boxed(text: str) -> str | None:
    """The reference's boxed extraction, faults included (reference doc sections 1.6 and 4.9).

    If the text contains ``"\\boxed "`` (with a space) anywhere, the answer is what follows the last such
    occurrence up to the next ``$`` (to the end when there is none), even when a ``\\boxed{...}`` comes later.
    Otherwise the braces are matched from the last ``\\boxed`` (or, when there is none, the last ``\\fbox``)
    and the box is unwrapped, which works only for a box that starts with ``\\boxed{``: a ``\\fbox{Paris}``
    or a ``\\boxed\\text{Paris}`` is found but cannot be unwrapped (the reference's unwrapping asserts the
    ``\\boxed{`` prefix and its caller turns the failure into a score of 0), so it gives ``None`` here.

    Returns:
        The box content, or ``None``: no box, braces never balanced, or a box that cannot be unwrapped.

    Source: reference doc section 1.6 (``last_boxed_only_string`` + ``remove_boxed``).
    """
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                box = text[start : i + 1]
                return box[len("\\boxed{") : -1] if box.startswith("\\boxed{") else None
    return None


def reference_strip_string(text: str) -> str:
    """The MATH-style ``strip_string`` the reference applies to both sides before comparing (reference doc
    sections 3.3 and 4.9), faults included.

    Deletes ``\\n`` (not ``\\r`` or tabs), ``\\!``, ``\\left``, ``\\right``, degree signs, ``\\$`` and
    ``\\%``; turns ``\\\\`` into ``\\`` and ``tfrac``/``dfrac`` into ``frac`` (inside words too); writes
    ``" ."`` as ``" 0."`` and ``"{."`` as ``"{0."``; deletes every space. Faults kept: a decimal that *starts*
    with a dot is left alone (the reference's comment promises a leading ``0``, its code never adds it), so
    ``.5`` does not equal ``0.5``; a plain ``%`` stays (its second percent rule repeats the backslash one), so
    ``50%`` does not equal ``50``.
    """
    s = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    return s.replace(" ", "")


@VERIFIERS.register("strict_boxed_reference")
def strict_boxed_reward_reference(response: str, answers: Sequence[str]) -> float:
    """The reference's training reward, reproduced exactly, faults included (kept for comparison).

    Reads only the last 300 characters of the response, lower-cases them, takes the last boxed answer
    (:func:`reference_last_boxed`) and compares it, after :func:`reference_strip_string`, with each
    lower-cased gold answer after the same function; 1.0 on any equality, else 0.0. Its faults, each kept:

    - a box that starts more than 300 characters before the end is not seen, and neither is one whose
      ``\\boxed`` the window cuts;
    - the window is lower-cased first, so ``\\BOXED{x}`` is a box;
    - a ``"\\boxed "`` with a space anywhere in the window wins over a later ``\\boxed{...}``, and its answer
      runs to the next ``$`` or the end (``\\boxed Paris.`` does not equal ``Paris``);
    - ``\\fbox{Paris}`` and ``\\boxed\\text{Paris}`` score 0 (found, but cannot be unwrapped);
    - ``\\boxed{0.5}`` against gold ``.5`` scores 0, and so does ``\\boxed{50%}`` against ``50``
      (:func:`reference_strip_string`);
    - spaces are ignored entirely (``new york`` equals ``newyork``), while tabs, carriage returns,
      punctuation and articles count (``The Beatles`` does not equal ``Beatles``);
    - an empty box equals an empty gold answer (1.0).

    Two inputs on which the reference raises instead of scoring score 0.0 here: an empty list of gold
    answers (the reference takes ``max`` of nothing) and a gold answer that is ``None`` (it is skipped; the
    reference calls ``.lower()`` on it).

    Differences from :func:`strict_boxed_reward`: see the list above; ours reads the whole response and
    compares after :func:`normalize_answer`.

    Source: reference doc sections 4.9 and 3.3 (``verl/utils/reward_score/hotpotqa.py:compute_score``).
    """
    golds = _as_list(answers)
    tail = (response or "")[-_REFERENCE_WINDOW_CHARS:].lower()
    boxed = reference_last_boxed(tail)
    if boxed is None or not golds:
        return 0.0
    pred = reference_strip_string(boxed)
    return float(any(pred == reference_strip_string(a.lower()) for a in golds))


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name``.

    Raises:
        UnknownNameError: no such verifier (the message suggests the closest name).
    """
    return VERIFIERS.get(name)


def score_all(prediction: str, answers: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """Score one prediction with several verifiers: ``{name: score}``."""
    return {n: get_verifier(n)(prediction, answers) for n in names}


# ------------------------------------------------------------------------------- guarded training reward

_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def answer_shape(answer: str) -> str | None:
    """A regular expression for strings of the same kind as a gold answer, or ``None`` for free text.

    Kinds: a run of ``n`` digits (RULER needle numbers, 7 digits), a word of ``n`` upper-case letters (variable
    names in vt, 5 letters), a version-4 UUID. Free-text answers (HotpotQA, qa) have no shape.
    """
    a = answer.strip()
    if re.fullmatch(r"\d+", a):
        return rf"(?<!\d)\d{{{len(a)}}}(?!\d)"
    if re.fullmatch(r"[A-Z]+", a):
        return rf"(?<![A-Za-z]){'[A-Z]'}{{{len(a)}}}(?![A-Za-z])"
    if re.fullmatch(_UUID, a.lower()):
        return rf"(?<![0-9a-f-]){_UUID}(?![0-9a-f-])"
    return None


@VERIFIERS.register("string_match_guarded")
def string_match_guarded(prediction: str, answers: Sequence[str]) -> float:
    """RULER all-match that an answer listing extra candidates of the gold's kind cannot game: the RULER reward.

    A gold answer of a known kind (:func:`answer_shape`: 7-digit numbers, 5-letter variable names, UUIDs) counts as
    found only as a whole string of that kind (``12345678`` does not contain the number ``2345678``), and a
    prediction that names more distinct strings of a kind than there are gold answers of that kind scores 0,
    whatever it contains: "1234567, 2345678, 3456789" against the gold 2345678 scores 0, "The special magic
    number for drab-cheek is 2345678." scores 1. Free-text gold answers have no kind and are matched as in
    :func:`string_match_all` (case-insensitive substring), so the guard does not reach them: "Paris London Berlin"
    against the gold Paris scores 1. The score is the share of distinct gold answers found (blank ones left out,
    a repeated one counted once, so a repeat does not raise the number of candidates allowed).

    Variable names are counted as upper-case words only: a five-letter word in lower or title case is ordinary
    prose ("There", "magic"), so "XYZAB, Abcde, Qwert" against XYZAB scores 1, and a lower-case answer
    ("xyzab") does not find the gold XYZAB. The RULER tasks the shipped policy trains on have number answers.

    Predictions get RULER's clean-up first (:func:`ruler_clean_prediction`).

    Source: memagent's own rule (issue 15: an answer that lists many candidates must not score); RULER's metric.
    """
    golds, seen = [], set()  # one gold per text, case aside (found strings of a kind are compared in lower case)
    for g in _nonblank(answers):
        g = unicodedata.normalize("NFC", g).strip()
        if g.lower() not in seen:
            seen.add(g.lower())
            golds.append(g)
    if not golds:
        return 0.0
    pred = ruler_clean_prediction(prediction)
    shapes = [answer_shape(g) for g in golds]
    found: dict[str, set[str]] = {}
    for shape in set(s for s in shapes if s is not None):
        found[shape] = {m.group(0).lower() for m in re.finditer(shape, pred, flags=re.IGNORECASE if "0-9a-f" in shape else 0)}
        if len(found[shape]) > shapes.count(shape):
            return 0.0
    hits = sum((g.strip().lower() in found[s]) if s is not None else (g.lower() in pred.lower())
               for g, s in zip(golds, shapes))
    return hits / len(golds)
