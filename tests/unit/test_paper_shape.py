"""benchmarks/paper_shape.py: the token arithmetic behind docs/training.md's 7B-shape table, on a hand-computed shape."""

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("paper_shape", Path(__file__).parents[2] / "benchmarks" / "paper_shape.py")
paper_shape = importlib.util.module_from_spec(spec)
sys.modules["paper_shape"] = paper_shape  # dataclasses look their module up
spec.loader.exec_module(paper_shape)


def test_tokens_per_question_by_hand():
    # head = template 2 + question 1 = 3; final head = 1 + 1 = 2; first prompt 3 + marker 1 + chunk 10 = 14;
    # a later prompt 3 + memory 3 + 10 = 16; the final prompt 2 + 3 = 5; G = 2 rollouts, 2 chunks
    s = paper_shape.Shape(chunks=2, chunk=10, memory=3, answer=1, group=2, prompts=1, template=2, final_template=1,
                          question=1, marker=1)
    q = paper_shape.per_question(s)
    assert q["prefill/unshared"] == 2 * (14 + 16 + 5) == 70
    assert q["rows/unshared"] == 70 + 2 * (2 * 3 + 1) == 84
    # reference order: the first prompt once, then the head once + per rollout (memory + chunk); final head once
    assert q["prefill/reference"] == 14 + (3 + 2 * (3 + 10)) + 2 + 2 * 3 == 51
    # chunk first: head and chunk once, per rollout only the memory
    assert q["prefill/chunk_first"] == 14 + (3 + 10 + 2 * 3) + 2 + 2 * 3 == 41
    assert (q["rows/reference"], q["rows/chunk_first"]) == (51 + 14, 41 + 14)
