"""Metrics aggregation and reports from result files only."""

import csv
import json
import math

import pytest

from memagent.errors import DataError
from memagent.eval.metrics import read_results, summarize
from memagent.eval.report import markdown_table, write_report


def _row(method, task, length, sid, score, status="ok", answer="x", unit="tokens"):
    return {
        "method": method, "task": task, "length": length, "length_unit": unit, "sample_id": sid, "status": status,
        "answer": answer, "metric": "sub_em", "score": score, "scores": {"sub_em": score, "f1": score / 2},
        "context_tokens": 1000 + length, "seconds": 2.0,
    }


def _write_run(folder, rows, name):
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "manifest.json").write_text(json.dumps({"name": name, "backend": "scripted", "tokenizer": "bytes", "seed": 0}))


def test_summarize_hand_computed():
    rows = [
        _row("m", "t", 8, "a", 1.0),
        _row("m", "t", 8, "b", 0.0, answer=""),
        _row("m", "t", 8, "c", 1.0, status="error"),  # an error scores 0 whatever its row says
        _row("m", "t", 8, "d", 1.0),
        _row("m", "t", 16, "a", 0.5),
    ]
    c8, c16 = summarize(rows)
    assert (c8.length, c8.n, c8.n_error, c8.n_empty) == (8, 4, 1, 1)
    assert c8.mean == 0.5 and c8.mean_ok == pytest.approx(2 / 3)
    assert c8.stderr == pytest.approx(math.sqrt((4 * 0.25 / 3) / 4))
    assert c8.means == {"sub_em": 0.5, "f1": 0.25}
    assert (c16.n, c16.stderr, c16.mean) == (1, 0.0, 0.5)
    assert c8.mean_context_tokens == 1008 and c8.mean_seconds == 2.0


def test_read_results_last_wins_and_torn_tail(tmp_path):
    p = tmp_path / "results.jsonl"
    rows = [_row("m", "t", 8, "a", 0.0, status="error"), _row("m", "t", 8, "a", 1.0)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"method": "m", "tas')
    (only,) = read_results(p)
    assert only["status"] == "ok" and only["score"] == 1.0
    p.write_text('{"bad\n' + json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match=r"results.jsonl:1: malformed"):
        read_results(p)
    with pytest.raises(DataError, match="not found"):
        read_results(tmp_path / "nope.jsonl")


def test_report_two_runs(tmp_path):
    a = [_row(m, "hotpotqa", n, s, float(s == "a"), unit="docs") for m in ("memagent", "direct") for n in (50, 100) for s in "ab"]
    b = [_row("memagent", "hotpotqa", 50, s, 1.0, unit="docs") for s in "ab"] + [_row("memagent", "vt", 8192, "a", 1.0)]
    _write_run(tmp_path / "r1", a, "base")
    _write_run(tmp_path / "r2", b, "new")
    files = write_report([tmp_path / "r1", tmp_path / "r2"], tmp_path / "out")
    assert [f.name for f in files] == ["summary.csv", "summary.md", "accuracy.png", "report.html"]
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 5000
    rows = list(csv.DictReader((tmp_path / "out" / "summary.csv").read_text().splitlines()))
    assert len(rows) == 4 + 1 + 1
    r = next(x for x in rows if x["method"] == "base/direct" and x["length"] == "100")
    assert (r["mean_pct"], r["stderr_pct"], r["n"], r["n_error"], r["f1_pct"]) == ("50.0", "50.0", "2", "0", "25.0")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| length | base/direct | base/memagent | new/memagent |" in md
    assert "| 50 docs (~1.1K tok) | 50.0 ± 50.0 | 50.0 ± 50.0 | 100.0 ± 0.0 |" in md
    assert "### vt (sub_em, %; n per cell = 1)" in md
    with pytest.raises(DataError, match="at least one"):
        write_report([])


def test_markdown_marks_errors_and_empties():
    cells = summarize([_row("m", "t", 1024, "a", 1.0), _row("m", "t", 1024, "b", 0.0, status="error")])
    assert "| 1K | 50.0 ± 50.0 (n=2, err=1, empty=0) |" in markdown_table([("m", c) for c in cells])


def test_runs_with_same_name_and_folder_name_stay_apart(tmp_path):
    _write_run(tmp_path / "a" / "val" / "s", [_row("policy", "val", 100, x, 1.0) for x in "pq"], "same")
    _write_run(tmp_path / "b" / "val" / "s", [_row("policy", "val", 100, "p", 0.0)], "same")
    write_report([tmp_path / "a" / "val" / "s", tmp_path / "b" / "val" / "s"], tmp_path / "out", plot=False)
    rows = {r["method"]: r for r in csv.DictReader((tmp_path / "out" / "summary.csv").read_text().splitlines())}
    assert set(rows) == {"a/val/s/policy", "b/val/s/policy"}
    assert (rows["a/val/s/policy"]["n"], rows["a/val/s/policy"]["mean_pct"]) == ("2", "100.0")
    assert (rows["b/val/s/policy"]["n"], rows["b/val/s/policy"]["mean_pct"]) == ("1", "0.0")


def test_partial_cells_give_their_n():
    from memagent.eval.metrics import summarize as summ

    rows = [_row("m", "hotpotqa", 50, s, 1.0, unit="docs") for s in "abcd"] + [_row("m", "hotpotqa", 100, "a", 0.0, unit="docs")]
    md = markdown_table([("m", c) for c in summ(rows)])
    assert "### hotpotqa (sub_em, %; n per cell up to 4; smaller cells give their n)" in md
    assert "| 100 docs (~1.1K tok) | 0.0 ± 0.0 (n=1) |" in md and "| 50 docs (~1.1K tok) | 100.0 ± 0.0 |" in md



def test_plot_labels_partial_cells_with_their_n():
    from memagent.eval.report import accuracy_figure

    rows = [_row(m, "t", n, s, 1.0) for m in ("memagent", "direct") for n in (8, 16) for s in "abcd"]
    rows += [_row("direct", "t", 32, s, float(s == "a")) for s in "ab"]  # a cell still running: 2 of 4
    rows += [_row("memagent", "u", 8, "a", 0.0)]
    fig = accuracy_figure([("x/" + c.method, c) for c in summarize(rows)])
    t_ax, u_ax = fig.axes
    assert [(t.get_text(), t.xy[1]) for t in t_ax.texts] == [("n=2", 50.0)]
    assert len(u_ax.texts) == 0 and t_ax.get_title() == "t"  # a task whose every cell has the same n needs no labels


def test_comparing_runs_needs_an_out_folder_and_keeps_units_and_metrics_apart(tmp_path):
    docs = [_row("m", "hotpotqa", 10, s, 1.0, unit="docs") for s in "ab"]
    tokens = [dict(_row("m", "hotpotqa", 10, s, 0.0), metric="f1") for s in "ab"]  # 10 tokens, scored by f1
    _write_run(tmp_path / "d", docs, "docs")
    _write_run(tmp_path / "t", tokens, "tokens")
    with pytest.raises(DataError, match="comparing 2 runs: give the output folder with --out"):
        write_report([tmp_path / "d", tmp_path / "t"])
    with pytest.raises(DataError, match=r"--out .* is one of the compared runs .*: the comparison would replace"):
        write_report([tmp_path / "d", tmp_path / "t"], tmp_path / "t" / ".." / "d")
    assert not (tmp_path / "d" / "summary.md").exists()
    write_report([tmp_path / "d", tmp_path / "t"], tmp_path / "out", plot=False)
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "### hotpotqa (%, metric per column; n per cell = 2)" in md
    assert "| length | docs/m [sub_em] | tokens/m [f1] |" in md
    assert "| 10 |  | 0.0 ± 0.0 |" in md  # the token row holds only the token run
    assert "| 10 docs (~1.0K tok) | 100.0 ± 0.0 |  |" in md
    with pytest.raises(DataError, match="cannot write the report into"):
        write_report([tmp_path / "d"], "/proc/memagent-report")


def test_rows_with_values_of_the_wrong_type_are_named(tmp_path):
    p = tmp_path / "results.jsonl"
    for change, message in [({"scores": {"sub_em": "x"}}, "score 'sub_em' is 'x', not a number"),
                            ({"context_tokens": "big"}, "'context_tokens' is 'big'")]:
        p.write_text(json.dumps({**_row("m", "t", 8, "a", 1.0), **change}) + "\n")
        with pytest.raises(DataError, match=f"results.jsonl:1: malformed result row \\({message}"):
            read_results(p)
    p.write_bytes(b"\xff\xfe\n")
    with pytest.raises(DataError, match="results.jsonl:1: result row is not UTF-8"):
        read_results(p)


def test_a_cell_mixing_metrics_is_refused():
    rows = [_row("m", "t", 8, "a", 1.0), dict(_row("m", "t", 8, "b", 1.0), metric="f1")]
    with pytest.raises(DataError, match=r"cell \(m, t, 8\) mixes rows of different settings"):
        summarize(rows)


def test_unreadable_manifest_is_named(tmp_path):
    _write_run(tmp_path / "r", [_row("m", "t", 8, "a", 1.0)], "r")
    (tmp_path / "r" / "manifest.json").write_text("[1]")
    with pytest.raises(DataError, match="manifest.json: a manifest is a JSON object, got list"):
        write_report([tmp_path / "r"], plot=False)


def test_a_torn_last_row_is_named_in_a_warning_and_left_out_as_eval_would_rerun_it(tmp_path, capsys):
    from memagent.eval.report import load_runs

    row = {"method": "m", "task": "t", "length": 1, "sample_id": "a", "status": "ok", "score": 1.0,
           "scores": {"sub_em": 1.0}, "metric": "sub_em"}
    run = tmp_path / "run"
    run.mkdir()
    whole = json.dumps(row) + "\n"
    (run / "results.jsonl").write_text(whole + json.dumps(dict(row, sample_id="b"))[:40])
    load_runs([run])
    err = capsys.readouterr().err
    assert f"warning: {run / 'results.jsonl'}:2: the last row was torn by a kill and is left out" in err
    # a whole row without its newline counts as torn too, as for eval (which cuts it and reruns the sample)
    (run / "results.jsonl").write_text(whole + json.dumps(dict(row, sample_id="b")))
    [(_, cells, _)] = load_runs([run])
    assert "results.jsonl:2: the last row was torn" in capsys.readouterr().err and cells[0].n == 1
    (run / "results.jsonl").write_text(whole + json.dumps(dict(row, sample_id="b")) + "\n")
    [(_, cells, _)] = load_runs([run])
    assert capsys.readouterr().err == "" and cells[0].n == 2
