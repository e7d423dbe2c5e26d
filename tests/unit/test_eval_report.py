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
    # a cell without a successful row has no mean over them (it read 0.0, like a cell of wrong answers)
    (bad,) = summarize([dict(r, status="error", error="x") for r in rows if r["length"] == 8])
    assert bad.mean == 0.0 and bad.mean_ok is None
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
    assert "### hotpotqa (sub_em, %; n per cell up to 4; (n=…) marks a cell with fewer samples than the fullest cell)" in md
    assert "| 100 docs (~1.1K tok) | 0.0 ± 0.0 (n=1) |" in md and "| 50 docs (~1.1K tok) | 100.0 ± 0.0 |" in md


def test_cells_short_of_the_samples_the_grid_asked_for_give_their_n(tmp_path):
    """Every cell has 3 samples of the 4 the manifest's grid asked for: not 'n per cell = 3' as if complete."""
    from memagent.eval.report import accuracy_figure, load_runs

    rows = [_row("m", "t", n, s, float(s != "c")) for n in (2048, 4096) for s in "abc"]
    rows += [_row("m", "u", 8, s, 1.0) for s in "abcd"]  # a task whose cells are complete
    _write_run(tmp_path / "r", rows, "r")
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    manifest["task_settings"] = {"t": {"samples": 4}, "u": {"samples": 4}}
    (tmp_path / "r" / "manifest.json").write_text(json.dumps(manifest))
    write_report([tmp_path / "r"], plot=False)
    md = (tmp_path / "r" / "summary.md").read_text()
    assert ("### t (sub_em, %; n per cell = 3 of 4 asked; (n=…) marks a cell with fewer samples than its grid asked "
            "for or than the fullest cell)") in md
    assert "| 2K | 66.7 ± 33.3 (n=3) |" in md and "| 4K | 66.7 ± 33.3 (n=3) |" in md
    assert "### u (sub_em, %; n per cell = 4)" in md and "| 8 | 100.0 ± 0.0 |" in md
    [(_, cells, _)] = load_runs([tmp_path / "r"])
    assert [(c.task, c.n, c.n_asked) for c in cells] == [("t", 3, 4), ("t", 3, 4), ("u", 4, 4)]
    t_ax, u_ax = accuracy_figure([("m", c) for c in cells]).axes  # the plot marks them the same way
    assert [t.get_text() for t in t_ax.texts] == ["n=3", "n=3"] and len(u_ax.texts) == 0
    # an older manifest without task_settings: its config's tasks say what was asked
    (tmp_path / "r" / "manifest.json").write_text(json.dumps({"config": {"tasks": [{"name": "t", "samples": 5}]}}))
    [(_, cells, _)] = load_runs([tmp_path / "r"])
    assert [(c.task, c.n_asked) for c in cells] == [("t", 5), ("t", 5), ("u", None)]
    for odd in ({"config": ["x"]}, {"config": {"tasks": "t"}}, {"task_settings": [1]}):  # hand-edited: no counts
        (tmp_path / "r" / "manifest.json").write_text(json.dumps(odd))
        [(_, cells, _)] = load_runs([tmp_path / "r"])
        assert {c.n_asked for c in cells} == {None}


def test_lengths_state_their_unit(tmp_path):
    rows = [_row("m", "vt", n, s, 1.0) for n in (189, 2048) for s in "ab"]
    _write_run(tmp_path / "r", rows, "r")
    write_report([tmp_path / "r"], plot=False)
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "| length (tokens) | m |" in md and "| 189 | 100.0 ± 0.0 |" in md and "| 2K | 100.0 ± 0.0 |" in md
    assert "| m | vt | 189 tok | 2 | 100.0 |" in md and "| m | vt | 2K tok | 2 | 100.0 |" in md  # diagnostics table
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<td>m</td><td>vt</td><td>2K tok</td><td>2</td>" in page
    rows = list(csv.DictReader((tmp_path / "r" / "summary.csv").read_text().splitlines()))
    assert [(r["length"], r["length_unit"]) for r in rows] == [("189", "tokens"), ("2048", "tokens")]


def test_plot_draws_one_panel_per_length_unit():
    from memagent.eval.report import accuracy_figure

    rows = [_row("m", "hotpotqa", n, s, 1.0, unit="docs") for n in (10, 20) for s in "ab"]
    rows += [_row("m2", "hotpotqa", n, s, 0.5) for n in (2048, 4096) for s in "ab"]
    rows += [_row("m", "vt", 2048, s, 1.0) for s in "ab"]
    docs, tokens, vt = accuracy_figure([(c.method, c) for c in summarize(rows)]).axes
    assert (docs.get_title(), docs.get_xlabel()) == ("hotpotqa (docs)", "documents")
    assert (tokens.get_title(), tokens.get_xlabel()) == ("hotpotqa (tokens)", "context length (tokens)")
    assert [t.get_text() for t in docs.get_xticklabels()] == ["10", "20"]
    assert [t.get_text() for t in tokens.get_xticklabels()] == ["2K", "4K"]
    assert [t.get_text() for t in docs.get_legend().get_texts()] == ["m"]
    assert [t.get_text() for t in tokens.get_legend().get_texts()] == ["m2"]
    assert (vt.get_title(), vt.get_xlabel()) == ("vt", "context length (tokens)")  # one unit: the task's name alone



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
    assert "| length | docs/m [sub_em] | tokens/m [f1] |" in md  # units mixed: each row names its own
    assert "| 10 tok |  | 0.0 ± 0.0 |" in md  # the token row holds only the token run
    assert "| 10 docs (~1.0K tok) | 100.0 ± 0.0 |  |" in md
    with pytest.raises(DataError, match="cannot write the report into"):
        write_report([tmp_path / "d"], "/proc/memagent-report")


def test_rows_with_values_of_the_wrong_type_are_named(tmp_path):
    p = tmp_path / "results.jsonl"
    for change, message in [({"scores": {"sub_em": "x"}}, "score 'sub_em' is 'x', not a number"),
                            ({"context_tokens": "big"}, "'context_tokens' is 'big'"),
                            *(({"document_chars": bad}, r"'document_chars' must be \[\[start, end\], ...\]")
                              for bad in ([[0]], [[0, "x"]], [[0, 1, 2]], [None], [[5, 2]], [[True, 3]]))]:
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


def test_a_cell_mixing_method_hashes_is_refused_naming_the_file(tmp_path):
    rows = [dict(_row("m", "t", 8, "a", 1.0), method_hash="aaa111"), dict(_row("m", "t", 8, "b", 0.0), method_hash="bbb222"),
            dict(_row("m", "t", 16, "a", 1.0), method_hash="bbb222")]
    _write_run(tmp_path / "r", rows, "r")
    with pytest.raises(DataError) as e:
        write_report([tmp_path / "r"], plot=False)
    assert str(e.value) == (f"{tmp_path / 'r' / 'results.jsonl'}: cell (m, t, 8) mixes rows made with different method "
                            "settings (method_hash 'aaa111', 'bbb222'): its mean would average two settings; keep one "
                            "setting's rows in that results file (rerun the other setting under another method name "
                            "or --output)")
    assert not (tmp_path / "r" / "summary.md").exists()
    with pytest.raises(DataError, match=r"^cell \(m, t, 8\) mixes rows made with different method settings \(method_hash "
                                        r"none, 'aaa111'\)"):  # a row without a hash counts as its own setting
        summarize([rows[0], _row("m", "t", 8, "b", 0.0)])
    assert [c.n for c in summarize(rows[1:])] == [1, 1]  # one hash per cell: fine


@pytest.mark.parametrize("change, shown", [({"score": float("nan")}, "score is nan"), ({"score": 1.5}, "score is 1.5"),
                                           ({"score": float("inf")}, "score is inf"),
                                           ({"scores": {"sub_em": 1.0, "f1": -0.25}}, "scores.f1 is -0.25")])
def test_a_score_that_is_not_a_fraction_is_refused_naming_the_line(tmp_path, change, shown):
    _write_run(tmp_path / "r", [_row("m", "t", 8, "a", 1.0), {**_row("m", "t", 8, "b", 1.0), **change}], "r")
    with pytest.raises(DataError) as e:
        write_report([tmp_path / "r"], plot=False)
    assert str(e.value) == (f"{tmp_path / 'r' / 'results.jsonl'}:2: malformed result row ({shown}; a score is a "
                            "fraction from 0 to 1); fix or remove that line (rescore it, or rerun that sample)")


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


PAYLOAD = "</script><script>alert(1)</script> <!-- x"


def test_report_html_embeds_any_document_text_safely(tmp_path):
    """A question, response or memory holding ``</script>``, ``<script`` and ``<!--`` stays data: the page's only
    script tags are its own, and the embedded JSON gives the texts back exactly."""
    run = tmp_path / "r"
    row = dict(_row("m", "t", 8, "a", 1.0), question="Q " + PAYLOAD, response="R " + PAYLOAD, answer="A & <b>",
               trace="traces/m.jsonl")
    _write_run(run, [row], "r")
    (run / "traces").mkdir()
    turns = [{"sample_id": "a", "turn": 0, "kind": "update", "chunk_index": 0, "memory": "M " + PAYLOAD,
              "chunk_chars": [0, 8]}, {"sample_id": "a", "turn": 1, "kind": "final", "memory": "M " + PAYLOAD}]
    (run / "traces" / "m.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    write_report([run], plot=False)
    page = (run / "report.html").read_text()
    assert page.count("</script") == 2 and page.count("<script") == 2 and "<!--" not in page
    head, rest = page.split('<script id="report-data" type="application/json">')
    data, tail = rest.split("</script>", 1)
    assert tail.startswith("\n<script>") and tail.count("</script>") == 1  # the page's own two elements, in order
    assert not {"<", ">", "&"} & set(data) and "\\u003c/script\\u003e" in data
    (s,) = json.loads(data)["samples"]
    assert (s["question"], s["response"], s["answer"]) == ("Q " + PAYLOAD, "R " + PAYLOAD, "A & <b>")
    assert "".join(text for op, text in s["timeline"][0]["diff"] if op != "-") == "M " + PAYLOAD


def test_out_may_not_be_another_runs_folder(tmp_path):
    _write_run(tmp_path / "r1", [_row("m", "t", 8, "a", 1.0)], "r1")
    _write_run(tmp_path / "r2", [_row("m", "t", 8, "a", 0.0)], "r2")
    with pytest.raises(DataError) as e:
        write_report([tmp_path / "r1"], tmp_path / "r2", plot=False)
    assert str(e.value) == (f"--out {str(tmp_path / 'r2')!r} is another eval run's folder (it holds results.jsonl), "
                            "not one of the runs reported: the report would replace that run's summary.csv, summary.md, "
                            "accuracy.png and report.html; give a folder that holds no run (or leave --out out to write "
                            "into the run reported)")
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "manifest.json").write_text("{}")  # a run that has not written a row yet
    with pytest.raises(DataError, match=r"r3' is another eval run's folder \(it holds manifest.json\)"):
        write_report([tmp_path / "r1", tmp_path / "r2"], tmp_path / "r3", plot=False)
    assert not any((tmp_path / d / "summary.md").exists() for d in ("r2", "r3"))
    write_report([tmp_path / "r1"], tmp_path / "r1" / ".." / "r1", plot=False)  # the run's own folder: allowed
    assert (tmp_path / "r1" / "summary.md").is_file()
    import shutil

    manifest = json.loads((tmp_path / "r1" / "manifest.json").read_text())
    (tmp_path / "r1" / "manifest.json").write_text(json.dumps({**manifest, "started_at": "2026-12-01T00:00:00Z"}))
    shutil.copytree(tmp_path / "r1", tmp_path / "committed")  # a committed copy of the same run: allowed
    (tmp_path / "committed" / "summary.md").unlink()
    write_report([tmp_path / "r1"], tmp_path / "committed", plot=False)
    assert (tmp_path / "committed" / "summary.md").is_file()
    (tmp_path / "r2" / "manifest.json").write_text(json.dumps({"name": "r1", "started_at": "2026-12-02T00:00:00Z"}))
    with pytest.raises(DataError, match="is another eval run's folder"):  # same name, another run
        write_report([tmp_path / "r1"], tmp_path / "r2", plot=False)


def test_no_plot_removes_an_earlier_plot(tmp_path, capsys):
    _write_run(tmp_path / "r", [_row("m", "t", 8, "a", 1.0)], "r")
    write_report([tmp_path / "r"])
    assert (tmp_path / "r" / "accuracy.png").is_file() and capsys.readouterr().err == ""
    files = write_report([tmp_path / "r"], plot=False)
    assert [f.name for f in files] == ["summary.csv", "summary.md", "report.html"]
    assert not (tmp_path / "r" / "accuracy.png").exists()
    assert capsys.readouterr().err == (f"removed {tmp_path / 'r' / 'accuracy.png'}: an earlier report's plot, stale beside "
                                       "this summary (--no-plot draws none)\n")
    write_report([tmp_path / "r"], plot=False)  # nothing to remove: nothing said
    assert capsys.readouterr().err == ""


def test_one_run_folder_may_be_given_alone(tmp_path):
    _write_run(tmp_path / "run2", [_row("m", "t", 8, "a", 1.0)], "run2")
    written = write_report(str(tmp_path / "run2"), plot=False)  # a string, not a list of its characters
    assert tmp_path / "run2" / "summary.md" in written


def test_a_row_whose_status_is_neither_ok_nor_error_is_malformed(tmp_path):
    # summaries counted such a row as failed (n_error 1) while eval's exit status and --retry-errors took it for a
    # finished sample (exit 0, never rerun): the three disagreed on one row
    p = tmp_path / "results.jsonl"
    good = _row("m", "t", 8, "a", 1.0)
    for status in ("OK", "failed", ""):
        p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "sample_id": "b", "status": status}) + "\n")
        with pytest.raises(DataError, match=rf"results.jsonl:2: malformed result row \(status is {status!r}, not 'ok' "
                                            r"or 'error'\); fix or remove that line"):
            read_results(p)
    p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "sample_id": "b", "status": "error", "score": 0.0}) + "\n")
    (c,) = summarize(read_results(p))
    assert (c.n, c.n_error, c.mean) == (2, 1, 0.5)
