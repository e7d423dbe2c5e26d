"""memagent.eval.demo: the side-by-side view of two agents' memories over one document."""

from types import SimpleNamespace

from memagent.eval.demo import Column, evidence_chunks, side_by_side
from memagent.types import Trajectory, Turn


def _traj(memories, answer):
    turns = [Turn("update", i, 10, 5, m, m, "stop", 0.0) for i, m in enumerate(memories)]
    turns.append(Turn("final", None, 10, 5, memories[-1], answer, "stop", 0.0))
    return Trajectory("s", "q", tuple(turns), answer, answer, "raw", 30)


def test_evidence_chunk_is_the_chunk_where_the_span_starts():
    chunks = [SimpleNamespace(index=i, start_char=10 * i, end_char=10 * i + 10) for i in range(3)]
    sample = SimpleNamespace(metadata={"evidence": [{"start_char": 19, "end_char": 25}]})
    assert evidence_chunks(sample, chunks) == [1]
    assert evidence_chunks(SimpleNamespace(metadata={}), chunks) == []


def test_columns_mark_the_needle_chunk_and_which_memory_holds_the_answer():
    lines = []
    base = _traj(["nothing yet", "still nothing"], "The number is 1.")
    trained = _traj(["nothing yet", "magic number 3144857"], "3144857")
    side_by_side([Column("untrained", base), Column("trained", trained)], ["3144857"], [1], width=20, echo=lines.append)
    assert lines == [
        "--- memory after chunk 1/2",
        "[untrained]" + " " * 9 + "  [trained]",
        "nothing yet" + " " * 9 + "  nothing yet",
        "--- memory after chunk 2/2   <- the needle is in this chunk",
        "[untrained]" + " " * 9 + "  [trained] (holds the answer)",
        "still nothing" + " " * 7 + "  magic number 3144857",
        "--- final answers",
        "[untrained] 'The number is 1.': wrong",
        "[trained] '3144857': correct",
        "gold: 3144857",
    ]
