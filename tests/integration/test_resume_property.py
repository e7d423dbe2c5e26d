"""Property: a `memagent run --resume` after a kill at any point gives the rows of an uninterrupted run
(scripted backend; issue 17, item 11). Deterministic (``derandomize=True``) and small."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memagent.cli import app

N_SAMPLES = 5


def _timeless(lines):
    """Rows without their wall-clock fields, in a stable order."""
    rows = [json.loads(x) for x in lines if x.strip()]
    for r in rows:
        r.pop("seconds", None)
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 1.0), failed=st.sets(st.integers(0, N_SAMPLES - 1), max_size=2))
def test_resume_after_a_kill_anywhere_gives_the_rows_of_a_whole_run(tmp_path_factory, cut, failed):
    d = tmp_path_factory.mktemp("resume")
    inp = d / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{i}", "question": f"q{i}?", "context": f"line {i}\n" * (3 + 7 * i)})
                           + "\n" for i in range(N_SAMPLES)))
    common = ["-b", "scripted", "--chunk-tokens", "16", "--memory-tokens", "64", "--final-tokens", "32",
              "--batch-size", "2"]
    ref_out, ref_trace = d / "ref.jsonl", d / "ref_trace.jsonl"
    assert _run("run", "-i", inp, "-o", ref_out, "--trace", ref_trace, *common).exit_code == 0
    rows, turns = ref_out.read_text().splitlines(True), ref_trace.read_text().splitlines(True)
    # The write stream of the whole run: each sample's turns, then its row, in the order samples finished.
    # A kill leaves a prefix of it: some whole samples, then part of one (turns only, or a torn line).
    stream = []
    for row in rows:
        sid = json.loads(row)["id"]
        stream += [("trace", t) for t in turns if json.loads(t)["sample_id"] == sid]
        if int(sid[1:]) in failed:  # this sample's request failed in the killed run: an error row
            row = json.dumps({**json.loads(row), "status": "error", "error": "killed run's failure"}) + "\n"
        stream.append(("out", row))
    cut_at = int(cut * sum(len(x) for _, x in stream))
    out, trace = d / "out.jsonl", d / "trace.jsonl"
    written = {"out": "", "trace": ""}
    for kind, text in stream:
        take = text[: max(0, cut_at)]
        written[kind] += take
        cut_at -= len(text)
        if cut_at <= 0:
            break
    out.write_text(written["out"])
    trace.write_text(written["trace"])
    r = _run("run", "-i", inp, "-o", out, "--trace", trace, "--resume", *common)
    assert r.exit_code == 0, r.output
    assert _timeless(out.read_text().splitlines()) == _timeless(rows)
    assert _timeless(trace.read_text().splitlines()) == _timeless(turns)
