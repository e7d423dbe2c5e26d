"""Answer extraction from a final response.

Order (documented fallback chain):
1. reasoning removed: text after the last ``</think>``; an unclosed ``<think>`` drops everything from it on;
2. ``boxed``: the content of the last ``\\boxed{...}`` (nested braces balanced; ``\\fbox{}`` too), its
   styling wrappers (``\\text{...}``, ``\\textbf``, ``\\textit``, ``\\emph``, ``\\mathbf`` ...) unwrapped;
3. ``answer_is``: the text after the last answer phrase or answer label, up to the end of that line (or the
   next non-empty line when the phrase ends its line), stripped of markdown emphasis, quotes and a final period.
   Styling wrappers are unwrapped as in a box (``Answer: $\\text{Paris}$`` gives ``$Paris$``). Phrases and
   labels, any case (the styles small instruct models write, see below):

   - "answer is", "the answer to this question is" / "... to the question is", each with an optional colon;
   - a line that starts with an answer label: ``Answer: Paris``, ``**Answer:** Paris``, ``**Answer**: Paris``,
     ``Final answer: Paris``, ``Your answer: Paris``, ``- Answer: Paris``;
   - a heading line made only of the label, the answer on the next line: ``**Final Answer**`` or
     ``### Final Answer`` and then ``Paris``.

   If the last phrase or label has no answer after it (``Your answer is:`` at the very end; only another
   label, as in a response that repeats "The answer is:"; or a lead-in ending in a colon, "the document
   contains the following:"), the one before it is used;
4. ``raw``: the whole remaining response, stripped (small models often answer without any format; lenient
   metrics such as sub-EM can still score it, the strict training reward never does);
5. ``empty``: nothing left.

Styles seen: SmolLM2-135M-Instruct in our own traces (``docs/results/embedded``) writes "The answer is X",
"The answer to this question is: "X"", "The answer to this question is:" with the answer on the next line,
"- Answer: The answer is "X"" and "Your answer is:" with nothing after it; Qwen2.5-Instruct models commonly
write markdown labels (``**Answer:** X``, ``**Final Answer:** X``, a ``**Final Answer**`` heading).

Source: reference doc section 1.6. Differences: the reference's "the answer is" match is case-sensitive and
yields no prediction otherwise (bug list item 5); memagent matches any case, reads answer labels too, and falls
back to the raw text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOX = re.compile(r"\\(?:boxed|fbox)")
# LaTeX wrappers that only style their text: \text, \textbf, \textit, \emph, \mathbf, \mathrm, \mbox ...
_TEXT = re.compile(r"\\(?:text(?:bf|it|rm|sf|tt|up|sl|sc|md|normal)?|emph|mbox|math(?:rm|bf|it|sf|tt))\{")
# "answer is", "answer to this/the question is" (the answer follows on the same line or a later one)
_ANSWER_IS = re.compile(r"answer(?:\s+to\s+(?:this|the)\s+question)?\s+is\s*:?", re.I)
# a line that starts (after markdown bullets, quotes, headings, emphasis) with an answer label and a colon, or
# is nothing but the label (a heading: the answer follows on the next non-empty line)
_LABEL = re.compile(r"^[ \t>#*_-]*(?:(?:final|your|the)[ \t]+)?answer[ \t*_]*(?::|(?=\n|$))", re.I | re.M)


@dataclass(frozen=True)
class ExtractedAnswer:
    answer: str
    method: str  # "boxed" | "answer_is" | "raw" | "empty"


def strip_reasoning(text: str) -> str:
    """Remove ``<think>...</think>`` reasoning: keep the text after the last ``</think>``; if a ``<think>``
    was opened and never closed, keep only the text before it."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return text.split("<think>", 1)[0]
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced nested braces.

    ``\\boxed 42`` (no brace) gives the text up to the next ``$`` or line end. Returns ``None`` when there is
    no box, or when the last box is never closed (a response cut off by the token limit).
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        k = _closing_brace(text, j)
        return None if k is None else text[j + 1 : k]
    if j > i:  # "\boxed 42$"
        rest = text[j:]
        return re.split(r"[$\n]", rest, maxsplit=1)[0].strip() or None
    return None


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``start`` (``\\{`` and ``\\}``, LaTeX's literal braces, do not
    count), or ``None`` when it is never closed."""
    depth, k = 0, start
    while k < len(text):
        c = text[k]
        if c == "\\":
            k += 2  # an escaped character: \{, \}, \\
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    return None


def unwrap_text(boxed: str) -> str:
    """``\\text{New} \\text{York}`` -> ``New York``: every ``\\text{...}`` (and the other styling wrappers:
    ``\\textbf``, ``\\textit``, ``\\textrm``, ``\\textsf``, ``\\texttt``, ``\\emph``, ``\\mbox``, ``\\mathrm``,
    ``\\mathbf``, ...) replaced by its content, braces matched (a greedy pattern took ``New} \\text{York``), nested
    ones too (``\\textbf{\\text{Paris}}`` -> ``Paris``)."""
    while True:
        out, i = [], 0
        for m in _TEXT.finditer(boxed):
            if m.start() < i:
                continue
            end = _closing_brace(boxed, m.end() - 1)
            if end is None:
                break
            out.append(boxed[i:m.start()] + boxed[m.end():end])
            i = end + 1
        if not out:
            return boxed
        boxed = "".join(out) + boxed[i:]


def _clean(text: str) -> str:
    """An answer without surrounding space, markdown emphasis, quotes or a final period."""
    return text.strip().rstrip(".").strip(" *_\"'").rstrip(".").strip()


def _text_after(body: str, end: int) -> str:
    """The answer after a phrase or label ending at ``end``: the rest of its line, else the next non-empty
    line."""
    line, _, rest = body[end:].partition("\n")
    return _clean(line) or next((c for c in map(_clean, rest.split("\n")) if c), "")


def extract_answer(text: str) -> ExtractedAnswer:
    """Extract the answer from a final response (see the module docstring for the fallback chain)."""
    body = strip_reasoning(text or "")
    boxed = last_boxed(body)
    if boxed is not None:
        return ExtractedAnswer(unwrap_text(boxed).strip(), "boxed")
    ends = sorted({m.end() for p in (_ANSWER_IS, _LABEL) for m in p.finditer(body)})
    for end in reversed(ends):  # the last phrase or label with an answer after it
        ans = _text_after(body, end)
        if ans and not ans.endswith(":") and not (_ANSWER_IS.search(ans) or _LABEL.match(ans)):
            return ExtractedAnswer(unwrap_text(ans), "answer_is")
    raw = body.strip()
    return ExtractedAnswer(raw, "raw") if raw else ExtractedAnswer("", "empty")
