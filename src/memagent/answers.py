"""Answer extraction from a final response.

Order (documented fallback chain):
1. reasoning removed: text after the last ``</think>``; an unclosed ``<think>`` drops everything from it on;
2. ``boxed``: the content of the last ``\\boxed{...}`` (nested braces balanced; ``\\fbox{}`` too), a
   ``\\text{...}`` wrapper around the whole content removed;
3. ``answer_is``: the text after the last "answer is" (any case, optional colon), up to the end of that line,
   stripped of markdown emphasis, quotes and a final period;
4. ``raw``: the whole remaining response, stripped (small models often answer without any format; lenient
   metrics such as sub-EM can still score it, the strict training reward never does);
5. ``empty``: nothing left.

Source: reference doc section 1.6. Differences: the reference's "the answer is" match is case-sensitive and
yields no prediction otherwise (bug list item 5); memagent matches any case and falls back to the raw text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOX = re.compile(r"\\(?:boxed|fbox)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{(.*)\}", re.S)
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*(.*)", re.I)


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
        depth = 0
        for k in range(j, len(text)):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1 : k]
        return None
    if j > i:  # "\boxed 42$"
        rest = text[j:]
        return re.split(r"[$\n]", rest, maxsplit=1)[0].strip() or None
    return None


def extract_answer(text: str) -> ExtractedAnswer:
    """Extract the answer from a final response (see the module docstring for the fallback chain)."""
    body = strip_reasoning(text or "")
    boxed = last_boxed(body)
    if boxed is not None:
        inner = _TEXT.fullmatch(boxed.strip())
        return ExtractedAnswer((inner.group(1) if inner else boxed).strip(), "boxed")
    found = list(_ANSWER_IS.finditer(body))
    if found:
        ans = found[-1].group(1).strip().rstrip(".").strip(" *_\"'").rstrip(".").strip()
        if ans:
            return ExtractedAnswer(ans, "answer_is")
    raw = body.strip()
    return ExtractedAnswer(raw, "raw") if raw else ExtractedAnswer("", "empty")
