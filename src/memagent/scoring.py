"""One scoring entry point for evaluation and RL rewards: ``score(verifier_name, response, answers)``.

A verifier (:mod:`memagent.verifiers`) compares a prediction with gold answers. Which prediction it sees is
decided here, once: the *strict* rewards (``strict_boxed*``) read the raw response (they look for the box
themselves, and a response without one scores 0), every other verifier reads the answer extracted from the
response (:func:`memagent.answers.extract_answer`). Eval rows and training rewards both call :func:`score`, so a
reward is always the score the same response gets in evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

from memagent.answers import extract_answer
from memagent.verifiers import get_verifier


def reads_raw_response(verifier_name: str) -> bool:
    """Whether ``verifier_name`` scores the raw response (the strict rewards) rather than the extracted answer."""
    return verifier_name.startswith("strict_boxed")


def score(verifier_name: str, response: str, answers: Sequence[str], answer: str | None = None) -> float:
    """The score in ``[0, 1]`` of a final response against gold answers.

    Args:
        verifier_name: a name registered in :data:`memagent.verifiers.VERIFIERS` (``sub_em``, ``strict_boxed``...).
        response: the final turn's raw text.
        answers: the gold answers (a lone string is one answer, as the verifiers themselves take it).
        answer: the answer already extracted from ``response`` (saves extracting it again).

    Raises:
        UnknownNameError: no verifier of that name (suggests the closest).
    """
    verifier = get_verifier(verifier_name)
    answers = [answers] if isinstance(answers, str) else list(answers)  # one gold answer, not its characters
    if reads_raw_response(verifier_name):
        return float(verifier(response, answers))
    if answer is None:
        answer = extract_answer(response).answer
    return float(verifier(answer, answers))


def scores(verifier_names: Sequence[str], response: str, answers: Sequence[str],
           answer: str | None = None) -> dict[str, float]:
    """``{name: score(name, response, answers)}`` for several verifiers (the answer is extracted once)."""
    if answer is None and not all(reads_raw_response(n) for n in verifier_names):
        answer = extract_answer(response).answer
    return {n: score(n, response, answers, answer) for n in verifier_names}
