"""Eval runner: rows per sample, error rows counted, resume after a kill, provenance, direct truncation."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from memagent.backends.scripted import ScriptedBackend
from memagent.data.io import write_samples
from memagent.errors import ConfigError, DataError
from memagent.eval.grid import EvalConfig, TaskConfig
from memagent.eval.metrics import read_results, summarize
from memagent.eval.runner import EvalRunner, ResultWriter
from memagent.types import Sample

GOLD = {"s0": "Paris", "s1": "Rome", "s2": "Oslo", "s3": "Lima"}
REPLY = {"s0": "\\boxed{Paris}", "s1": "The answer is Rome.", "s2": "\\boxed{Bern}", "s3": "   "}


def responder(req):
    sid, kind = req.request_id.split("/")
    if kind in ("final", "direct"):
        return REPLY[sid]
    return "notes"


def _data(tmp_path, length, doc_chars=300):
    samples = [Sample(sid, f"Capital number {sid}?", f"{sid} " + "filler text. " * (doc_chars // 13), (gold,)) for sid, gold in GOLD.items()]
    path = tmp_path / f"toy_{length}.jsonl"
    write_samples(path, samples)
    return str(path)


def _config(tmp_path, out="run", **kw):
    files = {100: _data(tmp_path, 100), 200: _data(tmp_path, 200, 900)}
    d = {
        "name": "toy",
        "output": str(tmp_path / out),
        "backend": {"name": "scripted"},
        "methods": [
            {"name": "memagent", "kind": "memory_agent", "chunk_tokens": 200, "memory_tokens": 64, "final_tokens": 64, "batch_size": 3},
            {"name": "direct", "kind": "direct", "max_input_tokens": 400, "max_new_tokens": 32, "batch_size": 3},
        ],
        "tasks": [{"name": "toy", "lengths": [100, 200], "samples": 4, "files": files}],
    }
    d.update(kw)
    return EvalConfig.from_dict(d)


def test_rows_scores_and_summary(tmp_path):
    cfg = _config(tmp_path)
    backend = ScriptedBackend(responder=responder)
    path = EvalRunner(cfg, backend=backend).run()
    rows = read_results(path)
    assert len(rows) == 2 * 2 * 4 and all(r["status"] == "ok" for r in rows)
    r0 = next(r for r in rows if r["method"] == "memagent" and r["sample_id"] == "s0" and r["length"] == 200)
    assert r0["answer"] == "Paris" and r0["extraction"] == "boxed" and r0["scores"] == {
        "sub_em": 1.0, "exact_match": 1.0, "f1": 1.0, "strict_boxed": 1.0}
    assert r0["turns"] == 1 + math.ceil(len(read_sample_context(cfg, 200, "s0").encode()) / 200)
    assert r0["trace"] == "traces/memagent/toy_200.jsonl" and (tmp_path / "run" / r0["trace"]).is_file()
    r1 = next(r for r in rows if r["method"] == "direct" and r["sample_id"] == "s1")
    assert r1["answer"] == "Rome" and r1["scores"]["sub_em"] == 1.0 and r1["scores"]["strict_boxed"] == 0.0
    for c in summarize(rows):
        assert (c.n, c.n_error, c.n_empty) == (4, 0, 1)
        assert c.mean == 0.5 and c.stderr == pytest.approx(math.sqrt((1 / 3) / 4))  # scores 1,1,0,0
        assert c.means["strict_boxed"] == 0.25
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["backend"] == "scripted" and manifest["tokenizer"] == "bytes"
    assert set(manifest["prompt_hashes"]) == {"memagent", "direct"} and len(manifest["prompt_hashes"]["direct"]) == 12
    assert manifest["config"]["tasks"][0]["lengths"] == [100, 200] and "package_version" in manifest


def read_sample_context(cfg, length, sid):
    from memagent.data.io import read_samples

    return next(s.context for s in read_samples(cfg.tasks[0].files[length]) if s.id == sid)


@pytest.mark.parametrize("batched", [True, False])  # False: the agent's threaded path for servers
def test_failed_requests_become_counted_error_rows(tmp_path, batched):
    cfg = _config(tmp_path)
    backend = ScriptedBackend(responder=responder, fail=lambda r: r.request_id.startswith("s1/"), batched=batched)
    rows = read_results(EvalRunner(cfg, backend=backend).run())
    assert len(rows) == 16
    errors = [r for r in rows if r["status"] == "error"]
    assert len(errors) == 4 and {r["sample_id"] for r in errors} == {"s1"}
    assert all("scripted failure" in r["error"] and r["score"] == 0.0 for r in errors)
    for c in summarize(rows):
        assert (c.n, c.n_error, c.n_empty) == (4, 1, 1)
        assert c.mean == 0.25 and c.mean_ok == pytest.approx(1 / 3)


def test_a_grids_scripted_backend_fails_the_requests_its_yaml_names(tmp_path):
    """The failure counting above, dry-run from a grid file alone: ``fail`` is a regex on request ids."""
    cfg = _config(tmp_path, backend={"name": "scripted", "fail": "^s2/"})
    rows = read_results(EvalRunner(cfg).run())
    errors = sorted((r["method"], r["length"], r["sample_id"]) for r in rows if r["status"] == "error")
    assert errors == [(m, n, "s2") for m in ("direct", "memagent") for n in (100, 200)]
    assert {r["error"] for r in rows if r["status"] == "error"} == {  # the agent stops at the first failed turn
        "s2/chunk0: scripted failure for s2/chunk0", "scripted failure for s2/direct"}
    # fail is not part of the method hash: without it, --retry-errors reruns just the failed samples
    rows = read_results(EvalRunner(_config(tmp_path, backend={"name": "scripted"}), retry_errors=True).run())
    assert len(rows) == 16 and all(r["status"] == "ok" for r in rows)
    for bad, message in (("(", r"fail '\(' is not a regular expression"), ("", "fail must be a regular expression")):
        with pytest.raises(ConfigError, match=message):
            ScriptedBackend(fail=bad)
    with pytest.raises(ConfigError, match=r"replies must be a list of reply texts, got 'abc' \(one reply: \['text'\]\)"):
        ScriptedBackend(replies="abc")  # not three replies 'a', 'b', 'c'
    with pytest.raises(ConfigError, match="batched must be true or false, got 'no'"):
        ScriptedBackend(batched="no")
    rows = read_results(EvalRunner(_config(tmp_path, backend={"name": "scripted"})).run(only_methods="direct"))
    assert {r["method"] for r in rows} == {"direct", "memagent"}  # one name, not the letters d, i, r, e, c, t


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing in the runner can swallow it."""


def test_resume_after_kill_gives_same_summary(tmp_path):
    full = read_results(EvalRunner(_config(tmp_path, out="full"), backend=ScriptedBackend(responder=responder)).run())

    calls = {"n": 0}

    def dying(req):
        calls["n"] += 1
        if calls["n"] > 9:
            raise Killed()
        return responder(req)

    cfg = _config(tmp_path, out="killed")
    with pytest.raises(Killed):
        EvalRunner(cfg, backend=ScriptedBackend(responder=dying)).run()
    results = tmp_path / "killed" / "results.jsonl"
    partial = results.read_text().splitlines()
    assert 0 < len(partial) < 16
    with open(results, "a") as f:  # a row torn by the kill
        f.write('{"method": "direct", "task": "toy", "len')
    second = ScriptedBackend(responder=responder)
    rows = read_results(EvalRunner(cfg, backend=second).run())
    lines = results.read_text().splitlines()
    assert len(lines) == 16 and len({(json.loads(x)["method"], json.loads(x)["length"], json.loads(x)["sample_id"]) for x in lines}) == 16
    assert [json.loads(x) for x in lines[: len(partial)]] == [json.loads(x) for x in partial]  # old rows kept
    done_before = {(json.loads(x)["method"], json.loads(x)["length"], json.loads(x)["sample_id"]) for x in partial}
    manifest = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert len(manifest["resumed_at"]) == 1
    rerun = {r.request_id.split("/")[0] for batch in second.calls for r in batch}
    assert rerun  # something was left to do ...
    strip = lambda cs: [(c.method, c.task, c.length, c.n, c.n_error, c.n_empty, c.mean, c.stderr) for c in cs]  # noqa: E731
    assert strip(summarize(rows)) == strip(summarize(full))  # ... and the result is as if never killed
    assert len(done_before) == len(partial)


def _check_trace(run, rows, length=100):
    """Every memagent row of the cell has its turns in the trace exactly once, numbered 0..turns-1, and every
    line of the trace is a whole turn of a sample that has a row."""
    text = (run / "traces" / "memagent" / f"toy_{length}.jsonl").read_text()
    assert text.endswith("\n")
    turns = [json.loads(x) for x in text.splitlines()]
    cell = {r["sample_id"]: r for r in rows if r["method"] == "memagent" and r["length"] == length}
    assert len(cell) == 4 and len(turns) == sum(r["turns"] for r in cell.values())
    for sid, r in cell.items():
        assert [t["turn"] for t in turns if t["sample_id"] == sid] == list(range(r["turns"]))
    return turns


def test_resume_drops_trace_turns_of_a_sample_killed_before_its_row(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    real = ResultWriter.write

    def dying(self, row):  # the kill lands after s2's turns are written, before its row
        if (row["method"], row["length"], row["sample_id"]) == ("memagent", 100, "s2"):
            raise Killed()
        real(self, row)

    monkeypatch.setattr(ResultWriter, "write", dying)
    with pytest.raises(Killed):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    trace = tmp_path / "run" / "traces" / "memagent" / "toy_100.jsonl"
    before = [json.loads(x)["sample_id"] for x in trace.read_text().splitlines()]
    assert "s2" in before and "s2" not in {json.loads(x)["sample_id"] for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()}
    monkeypatch.setattr(ResultWriter, "write", real)
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run())
    assert len(rows) == 16
    _check_trace(tmp_path / "run", rows)
    _check_trace(tmp_path / "run", rows, 200)


def test_resume_drops_a_trace_line_torn_by_a_kill(tmp_path, monkeypatch):
    import memagent.eval.runner as loop  # the runner writes traces through memagent.runfiles
    from memagent.runfiles import trace_rows

    cfg = _config(tmp_path)
    real = loop.write_trace

    def torn(path, trajs, append=False):  # killed in the middle of s1's second turn
        if trajs[0].sample_id == "s1":
            first, second = (json.dumps(r) for r in trace_rows(trajs[0])[:2])
            with open(path, "a") as f:
                f.write(first + "\n" + second[: len(second) // 2])
            raise Killed()
        real(path, trajs, append)

    monkeypatch.setattr(loop, "write_trace", torn)
    with pytest.raises(Killed):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    trace = tmp_path / "run" / "traces" / "memagent" / "toy_100.jsonl"
    assert not trace.read_text().endswith("\n")
    monkeypatch.setattr(loop, "write_trace", real)
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run())
    assert len(rows) == 16
    _check_trace(tmp_path / "run", rows)


def test_retry_errors_replaces_the_failed_attempts_trace_turns(tmp_path):
    cfg = _config(tmp_path)
    failing = ScriptedBackend(responder=responder, fail=lambda r: r.request_id == "s1/final")
    rows = read_results(EvalRunner(cfg, backend=failing).run())
    failed = next(r for r in rows if (r["method"], r["length"], r["sample_id"]) == ("memagent", 100, "s1"))
    assert failed["status"] == "error" and failed["turns"] > 1
    turns = _check_trace(tmp_path / "run", rows)
    assert [t["finish_reason"] for t in turns if t["sample_id"] == "s1"][-1] == "error"
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder), retry_errors=True).run())
    assert len(rows) == 16 and all(r["status"] == "ok" for r in rows)  # the retry's rows supersede the errors
    turns = _check_trace(tmp_path / "run", rows)
    assert all(t["finish_reason"] != "error" for t in turns)
    _check_trace(tmp_path / "run", rows, 200)


def test_retry_errors_supersedes_error_rows(tmp_path):
    cfg = _config(tmp_path)
    EvalRunner(cfg, backend=ScriptedBackend(responder=responder, fail=lambda r: r.request_id.startswith("s1/"))).run()
    again = ScriptedBackend(responder=responder)
    rows = read_results(EvalRunner(cfg, backend=again).run())
    assert sum(r["status"] == "error" for r in rows) == 4 and not again.calls  # plain resume skips error rows
    rows = read_results(EvalRunner(cfg, backend=again, retry_errors=True).run())
    assert sum(r["status"] == "error" for r in rows) == 0 and len(rows) == 16
    assert all(c.mean == 0.5 for c in summarize(rows))


def test_changed_method_settings_refuse_to_mix(tmp_path):
    EvalRunner(_config(tmp_path), backend=ScriptedBackend(responder=responder)).run()
    cfg2 = _config(tmp_path, seed=7)
    with pytest.raises(ConfigError, match=r"method 'memagent' made with other settings \(hash [0-9a-f]{12}: seed: 0 -> 7\)"):
        EvalRunner(cfg2, backend=ScriptedBackend(responder=responder)).run()
    d = _config(tmp_path).to_dict()
    d["methods"][0]["memory_tokens"] = 32
    with pytest.raises(ConfigError, match=r"\(hash [0-9a-f]{12}: method.memory_tokens: 64 -> 32\); use a new --output"):
        EvalRunner(EvalConfig.from_dict(d), backend=ScriptedBackend(responder=responder)).run()


def test_direct_center_truncates_document(tmp_path):
    doc = "HEAD " + "x" * 5000 + " TAIL"
    path = tmp_path / "long.jsonl"
    write_samples(path, [Sample("s0", "Q?", doc, ("zeta",))])
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "d"), "backend": {"name": "scripted"},
        "methods": [{"name": "direct", "kind": "direct", "max_input_tokens": 1000, "max_new_tokens": 16}],
        "tasks": [{"name": "long", "lengths": [1], "samples": 1, "files": {1: str(path)}}],
    })
    backend = ScriptedBackend(replies=["\\boxed{Zeta}"])
    (row,) = read_results(EvalRunner(cfg, backend=backend).run())
    (req,) = backend.calls[0]
    prompt = req.messages[0].content
    assert len(prompt.encode()) <= 1000 and "HEAD" in prompt and "TAIL" in prompt and "Q?" in prompt
    from memagent.eval.runner import DIRECT_TEMPLATE

    fixed = len(DIRECT_TEMPLATE.format(document="", question="Q?").encode())  # scripted backend counts bytes
    assert row["document_tokens"] == 1000 - fixed - 2 and len(prompt.encode()) == 998
    # the row records the ranges its prompt kept, so the report needs no second cut (one that could differ)
    (_, head), (tail, end) = row["document_chars"]
    assert end == len(doc) and head + end - tail == row["document_tokens"] and doc[:head] + doc[tail:] in prompt
    assert row["document_tokens"] < len(doc) and row["context_tokens"] is None and row["score"] == 1.0
    # a document whose whole prompt fits the cap is sent whole, even inside the 2-token margin truncation keeps
    for extra, whole in [(0, True), (1, False)]:  # whole prompts of exactly 1000 and of 1001 bytes
        short = "y" * (1000 - fixed + extra - 1) + "."
        write_samples(path, [Sample("s0", "Q?", short, ("zeta",))])
        backend = ScriptedBackend(replies=["\\boxed{Zeta}"])
        out = tmp_path / f"fits{extra}"
        (row,) = read_results(EvalRunner(replace(cfg, output=str(out)), backend=backend).run())
        sent = backend.calls[0][0].messages[0].content
        assert (short in sent, row["document_tokens"]) == ((True, len(short)) if whole else (False, 1000 - fixed - 2))
        assert (row["document_chars"] == [[0, len(short)]]) == whole
        assert len(sent.encode()) <= 1000
    # a cap too small for a truncated document still takes a document that fits whole (it was refused first)
    write_samples(path, [Sample("s0", "Q?", "ab", ("zeta",))])
    tiny = replace(cfg, output=str(tmp_path / "tiny"),
                   methods=(replace(cfg.methods[0], max_input_tokens=len(DIRECT_TEMPLATE.format(document="ab", question="Q?").encode())),))
    (row,) = read_results(EvalRunner(tiny, backend=ScriptedBackend(replies=["\\boxed{Zeta}"])).run())
    assert (row["status"], row["document_chars"]) == ("ok", [[0, 2]])


def test_budget_failure_is_an_error_row(tmp_path):
    path = tmp_path / "q.jsonl"
    write_samples(path, [Sample("ok", "Q?", "doc", ("a",)), Sample("long", "Q" * 9000, "doc", ("a",))])
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "b"), "backend": {"name": "scripted", "context_tokens": 4096},
        "methods": [{"name": "m", "chunk_tokens": 500, "memory_tokens": 64, "final_tokens": 64},
                    {"name": "d", "kind": "direct", "max_input_tokens": 2000, "max_new_tokens": 64}],
        "tasks": [{"name": "t", "lengths": [1], "samples": 2, "files": {1: str(path)}}],
    })
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(context_tokens=4096)).run())
    agent = {r["sample_id"]: r for r in rows if r["method"] == "m"}
    direct = {r["sample_id"]: r for r in rows if r["method"] == "d"}
    assert agent["ok"]["status"] == "ok" and agent["long"]["status"] == "error" and "context window" in agent["long"]["error"]
    assert direct["ok"]["status"] == "ok" and direct["long"]["status"] == "error"
    assert "over the prompt cap of 2000 tokens" in direct["long"]["error"]
    assert agent["long"]["error"].startswith("not run: ") and direct["long"]["error"].startswith("not run: ")


@pytest.mark.parametrize("method, message", [
    ({"name": "m", "chunk_tokens": 5000, "memory_tokens": 64, "final_tokens": 64}, "method 'm': .*update call needs"),
    ({"name": "d", "kind": "direct", "max_input_tokens": 4000, "max_new_tokens": 200}, "4000 \\+ max_new_tokens 200 exceeds"),
    ({"name": "d", "kind": "direct", "max_new_tokens": 4096}, "leaves no room for a prompt"),
    ({"name": "d", "kind": "direct", "max_input_tokens": 40, "max_new_tokens": 16},
     r"method 'd': the direct prompt takes (\d+) tokens without any document or question, and a truncated document "
     r"needs 4 more: \d+ tokens, over the prompt cap of 40 tokens; raise max_input_tokens"),
])
def test_impossible_methods_fail_before_any_row(tmp_path, method, message):
    path = tmp_path / "q.jsonl"
    write_samples(path, [Sample("ok", "Q?", "doc", ("a",))])
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "b"), "backend": {"name": "scripted", "context_tokens": 4096}, "methods": [method],
        "tasks": [{"name": "t", "lengths": [1], "samples": 1, "files": {1: str(path)}}],
    })
    with pytest.raises(ConfigError, match=message):
        EvalRunner(cfg, backend=ScriptedBackend(context_tokens=4096)).run()
    assert not (tmp_path / "b").exists()  # the folder this call made is removed: a bad config leaves no trace
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=message):
        EvalRunner(cfg, backend=ScriptedBackend(context_tokens=4096)).run()
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine"  # a folder that was there is kept
    assert not (tmp_path / "b" / "results.jsonl").read_text()


def test_a_run_refused_for_its_data_leaves_no_folder_and_the_corrected_grid_starts_afresh(tmp_path):
    path = tmp_path / "q.jsonl"
    write_samples(path, [Sample("a", "Q?", "doc", ("a",)), Sample("b", "Q?", "doc", ("a",))])
    grid = {"output": str(tmp_path / "run"), "backend": {"name": "scripted"},
            "methods": [{"name": "m", "chunk_tokens": 500, "memory_tokens": 64, "final_tokens": 64}],
            "tasks": [{"name": "t", "lengths": [1, 2], "samples": 2, "files": {1: str(path), 2: str(tmp_path / "none.jsonl")}}]}
    with pytest.raises(DataError, match="none.jsonl"):
        EvalRunner(EvalConfig.from_dict({**grid, "output": str(tmp_path / "nest" / "a" / "run")}),
                   backend=ScriptedBackend()).run()
    assert not (tmp_path / "nest").exists()  # the folders made on the way go too
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "mine.txt").write_text("x")
    with pytest.raises(DataError, match="none.jsonl"):
        EvalRunner(EvalConfig.from_dict({**grid, "output": str(tmp_path / "keep" / "a" / "run")}),
                   backend=ScriptedBackend()).run()
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["mine.txt"]
    with pytest.raises(DataError, match="none.jsonl"):
        EvalRunner(EvalConfig.from_dict(grid), backend=ScriptedBackend()).run()
    assert not (tmp_path / "run").exists()  # its manifest and lock went with it
    grid["tasks"][0].update(lengths=[1], samples=1, files={1: str(path)})
    rows = read_results(EvalRunner(EvalConfig.from_dict(grid), backend=ScriptedBackend()).run())
    assert [r["sample_id"] for r in rows] == ["a"]


def test_result_writer_repairs_torn_tail(tmp_path):
    p = tmp_path / "results.jsonl"
    good = {"method": "m", "task": "t", "length": 1, "sample_id": "a", "status": "ok", "score": 1.0, "scores": {"sub_em": 1.0}}
    p.write_text(json.dumps(good) + "\n" + '{"method": "m", "ta')
    w = ResultWriter(p)
    assert w.done == {("m", "t", 1, "a"): "ok"}
    w.write(dict(good, sample_id="b"))
    w.close()
    assert [json.loads(x)["sample_id"] for x in p.read_text().splitlines()] == ["a", "b"]


def test_grid_errors_and_shipped_configs(tmp_path):
    with pytest.raises(ConfigError, match=r"eval config '.*' is a folder: give the grid's YAML file"):
        EvalConfig.from_yaml(tmp_path)
    with pytest.raises(ConfigError, match=r"eval config '.*none.yaml' not found"):
        EvalConfig.from_yaml(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match="did you mean 'chunk_tokens'"):
        EvalConfig.from_dict({"methods": [{"name": "m", "chunk_token": 5}], "tasks": [{"name": "t", "lengths": [1]}]})
    with pytest.raises(ConfigError, match="did you mean 'tasks'"):
        EvalConfig.from_dict({"methods": [{"name": "m"}], "task": []})
    with pytest.raises(ConfigError, match="^config: the eval grid needs at least one method"):
        EvalConfig.from_dict({"methods": [], "tasks": [{"name": "vt", "lengths": [1]}]})
    m = [{"name": "m"}]
    bad = [  # each mistake is a ConfigError that names the place, found before any cell runs
        ({"tasks": ["vt"]}, r"tasks\[0\]: expected a mapping like"),
        ({"tasks": {"vt": {"lengths": [8]}}}, "tasks must be a list of mappings"),
        ({"tasks": [{"name": "niah_singel_1", "lengths": [8]}]}, "did you mean 'niah_single_1'"),
        ({"tasks": [{"name": "vt", "lengths": [8], "metrics": ["sub_emm"]}]}, "unknown metric 'sub_emm' .did you mean 'sub_em'"),
        ({"tasks": [{"name": "x", "lengths": [8], "files": ["a.jsonl"]}]}, r"tasks\[0\].files: give a mapping"),
        ({"tasks": [{"name": "x", "lengths": [8], "metrics": [1]}]}, "give metric names"),
        ({"tasks": [{"name": "hotpotqa", "lengths": ["8K"]}]}, "a number of documents takes no K/M suffix"),
        ({"tasks": [{"name": "vt", "lengths": [8]}, {"name": "vt", "lengths": [16]}]},
         r"^g.yaml: task names must be unique \(ignoring case\), got 'vt' twice"),
        ({"methods": [{"name": "a"}, {"name": "b"}, {"name": "a"}], "tasks": [{"name": "vt", "lengths": [8]}]},
         r"^g.yaml: method names must be unique \(ignoring case\), got 'a' twice \(methods \['a', 'b', 'a'\]\)"),
        # on a case-insensitive file system (macOS, Windows) their trace folders would be one
        ({"methods": [{"name": "rl"}, {"name": "RL"}], "tasks": [{"name": "vt", "lengths": [8]}]},
         r"^g.yaml: method names must be unique \(ignoring case\), got 'rl' and 'RL' \(methods"),
        ({"tasks": [{"name": "mine", "lengths": [8], "files": {8: "a.jsonl"}},
                    {"name": "Mine", "lengths": [8], "files": {8: "b.jsonl"}}]},
         "^g.yaml: task names must be unique .ignoring case., got 'mine' and 'Mine':"),
        ({"tasks": [{"name": "vt", "lengths": [8]}], "top_p": 0.0}, "^g.yaml: .*top_p"),
        ({"tasks": [{"name": "vt", "lengths": [8], "keep_incomplete": True}]}, "keep_incomplete applies to hotpotqa"),
        ({"tasks": [{"name": "../../evil", "lengths": [8], "files": {8: "a.jsonl"}}]},
         r"task name '../../evil': it becomes part of file names in the run folder, so it must be non-empty"),
        ({"methods": [{"name": "a/b"}], "tasks": [{"name": "vt", "lengths": [8]}]}, "method name 'a/b': it becomes part"),
        ({"methods": [{"name": ".hidden"}], "tasks": [{"name": "vt", "lengths": [8]}]}, "must not start with '.'"),
        ({"tasks": [{"name": "vt", "lengths": ["2,048"]}]},
         r"tasks\[0\].lengths: '2,048' holds a comma; give several lengths as a YAML list \(\[8K, 16K\]\) and write "
         r"each without thousands separators \(16384, not 16,384\)$"),
        ({"tasks": [{"name": "vt", "lengths": "16,384"}]}, r"tasks\[0\].lengths: '16,384' holds a comma"),  # not 16 and 384
        ({"tasks": [{"name": "mine", "lengths": [2048], "files": {"2K": "a.jsonl", 2048: "b.jsonl"}}]},
         r"tasks\[0\].files: the keys '2K' and 2048 name one length \(2048\), so one file would be left out"),
        ({"tasks": [{"name": "mine", "lengths": [2048], "files": {"2,048": "a.jsonl"}}]},
         r"tasks\[0\].files: the key '2,048' holds a comma"),
        ({"methods": [{"name": "caf\u00e9"}, {"name": "cafe\u0301"}], "tasks": [{"name": "vt", "lengths": [8]}]},
         r"method names must be unique .ignoring case., got 'caf\\xe9' and 'cafe\\u0301'"),  # one name on macOS
        ({"methods": [{"name": "rl"}, {"name": "rl."}], "tasks": [{"name": "vt", "lengths": [8]}]},
         r"got 'rl' and 'rl\.'"),  # one name on Windows
        # a setting of the other kind of method would be silently ignored
        ({"methods": [{"name": "d", "kind": "direct", "chunk_tokens": 1000}], "tasks": [{"name": "vt", "lengths": [8]}]},
         r"^g.yaml: methods\[0\]: method 'd' \(kind direct\): chunk_tokens applies to kind memory_agent only and "
         "would be ignored; remove it, or set kind: memory_agent$"),
        ({"methods": [{"name": "a", "max_input_tokens": 5, "max_new_tokens": 9}], "tasks": [{"name": "vt", "lengths": [8]}]},
         r"method 'a' \(kind memory_agent\): max_input_tokens, max_new_tokens apply to kind direct only"),
    ]
    for grid, message in bad:
        with pytest.raises(ConfigError, match=message):
            EvalConfig.from_dict({"methods": m, **grid}, "g.yaml")
    ok = EvalConfig.from_dict({"methods": m, "tasks": [
        {"name": "vt", "lengths": [8], "metrics": "string_match_part"},  # one metric as a plain string
        {"name": "mine", "lengths": ["2K"], "files": {"2K": "d/mine.jsonl", 4096: "/abs/x.jsonl"}},
        {"name": "hotpotqa", "lengths": ["8K", "4K", 8192, "8k", "16K"], "unit": "tokens"},
    ]}, "g.yaml", base="/cfg")
    assert ok.tasks[0].metrics == ("string_match_part",) and ok.tasks[2].lengths == (8192, 4096, 16384)  # each once
    with pytest.raises(ConfigError, match=r"task 'vt': lengths \[8, 8\] name a length twice"):
        TaskConfig("vt", (8, 8))
    # from Python the fields are checked and converted as the YAML's are (they were kept as given: "2K" or 2048.0
    # failed at the first cell, 2048 alone was a TypeError)
    t = TaskConfig("niah_single_2", "2K", samples=4, files={"4K": Path("a.jsonl")}, metrics="string_match_all")
    assert (t.lengths, t.files, t.metrics) == ((2048,), {4096: "a.jsonl"}, ("string_match_all",))
    assert TaskConfig("vt", [8, "16K"]).lengths == (8, 16384)
    import numpy as np

    assert TaskConfig("vt", (np.int64(2048),), samples=np.int64(4)).lengths == (2048,)  # computed with numpy
    for kw, message in [({"lengths": (2048.0,)}, r"lengths: 2048\.0 is not a length"),
                        ({"lengths": (True,)}, r"lengths: True is not a length"),
                        ({"lengths": (2048, "2K")}, r"lengths \[2048, 2048\] name a length twice"),
                        ({"lengths": (8,), "samples": "4"}, r"task 'vt': samples must be an integer, got '4'"),
                        ({"lengths": (8,), "files": {"8": 5}}, r"task 'vt': files")]:
        with pytest.raises(ConfigError, match=message):
            TaskConfig("vt", **kw)
    assert ok.tasks[1].files == {2048: "/cfg/d/mine.jsonl", 4096: "/abs/x.jsonl"}  # relative to the config's folder

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("eval_*.yaml"))
    assert configs
    for c in configs:
        cfg = EvalConfig.from_yaml(c)
        assert cfg.methods and cfg.tasks


def test_hotpotqa_cell_is_built_once_and_reused(tmp_path, data_root):
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "h"), "backend": {"name": "scripted"}, "data_root": str(data_root),
        "methods": [{"name": "direct", "kind": "direct", "max_input_tokens": 1500, "max_new_tokens": 16}],
        "tasks": [{"name": "hotpotqa", "lengths": [12], "samples": 2}],
    })
    runner = EvalRunner(cfg, backend=ScriptedBackend(replies=["\\boxed{yes}", "x"]))
    rows = read_results(runner.run())
    data = tmp_path / "h" / "data" / "hotpotqa_12.jsonl"
    samples = runner.cell_samples(cfg.tasks[0], 12)
    assert data.is_file() and [s.metadata["num_docs"] for s in samples] == [12, 12]
    assert [r["sample_id"] for r in rows] == [s.id for s in samples] and rows[0]["length_unit"] == "docs"
    assert rows[0]["answers"] == ["yes"] and rows[0]["scores"]["strict_boxed"] == 1.0  # first dev question
    assert rows[0]["context_tokens"] == len(samples[0].context.encode())  # bytes tokenizer


def test_only_runs_cells_in_pieces_and_matches_one_run(tmp_path):
    full = read_results(EvalRunner(_config(tmp_path, out="full"), backend=ScriptedBackend(responder=responder)).run())
    cfg = _config(tmp_path, out="pieces")
    first = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only=[("toy", 200)]))
    assert {(r["method"], r["length"]) for r in first} == {("memagent", 200), ("direct", 200)} and len(first) == 8
    rest = ScriptedBackend(responder=responder)
    rows = read_results(EvalRunner(cfg, backend=rest).run(only=[("toy", None)]))
    assert {r.request_id.split("/")[0] for batch in rest.calls for r in batch} == set(GOLD)  # only length 100 ran
    assert len(rows) == 16
    key = lambda r: (r["method"], r["length"], r["sample_id"], r["response"], r["score"])  # noqa: E731
    assert sorted(map(key, rows)) == sorted(map(key, full))
    with pytest.raises(ConfigError, match="no length 300"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only=[("toy", 300)])
    with pytest.raises(ConfigError, match="task 'vt' is not in the grid"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only=[("vt", None)])


def test_only_methods_runs_one_method_first_and_matches_one_run(tmp_path):
    full = read_results(EvalRunner(_config(tmp_path, out="full"), backend=ScriptedBackend(responder=responder)).run())
    cfg = _config(tmp_path, out="bymethod")
    first = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only_methods=["direct"]))
    assert {r["method"] for r in first} == {"direct"} and len(first) == 8
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run())
    assert len(rows) == 16 and [r["method"] for r in rows[8:]] == ["memagent"] * 8
    key = lambda r: (r["method"], r["length"], r["sample_id"], r["response"], r["score"])  # noqa: E731
    assert sorted(map(key, rows)) == sorted(map(key, full))
    with pytest.raises(ConfigError, match=r"--only-methods: 'agent' is not a method of the grid \(the grid's methods, by name: memagent, direct\)"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only_methods=["agent"])
    with pytest.raises(ConfigError, match="--only-methods: name at least one method"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only_methods=[])


def test_manifest_keeps_methods_that_have_rows(tmp_path):
    from memagent.eval.report import write_report

    both = _config(tmp_path)
    EvalRunner(both, backend=ScriptedBackend(responder=responder)).run()
    first = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert set(first["method_hashes"]) == {"memagent", "direct"}
    agent_only = _config(tmp_path, methods=[both.to_dict()["methods"][0]],
                         tasks=[dict(both.to_dict()["tasks"][0], lengths=[100], samples=4)])
    rows = read_results(EvalRunner(agent_only, backend=ScriptedBackend(responder=responder)).run())
    assert len(rows) == 16 and sum(r["method"] == "direct" for r in rows) == 8
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["method_hashes"] == first["method_hashes"] and m["prompt_hashes"] == first["prompt_hashes"]
    assert [x["name"] for x in m["config"]["methods"]] == ["memagent", "direct"]
    assert m["config"]["methods"][1] == first["config"]["methods"][1] and len(m["resumed_at"]) == 1
    summary = write_report([tmp_path / "run"], plot=False)[1].read_text()
    assert f"'direct': '{first['prompt_hashes']['direct']}'" in summary
    assert f"'memagent': '{first['prompt_hashes']['memagent']}'" in summary

    # a method listed in the manifest but without rows is dropped; one with rows that an older manifest lost
    # gets its rows' method hash back
    m["method_hashes"].pop("direct")
    m["prompt_hashes"].pop("direct")
    m["config"]["methods"] = m["config"]["methods"][:1] + [dict(m["config"]["methods"][1], name="gone")]
    m["method_hashes"]["gone"] = "0" * 12
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(m))
    EvalRunner(agent_only, backend=ScriptedBackend(responder=responder)).run()
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["method_hashes"] == first["method_hashes"] and set(m["prompt_hashes"]) == {"memagent"}
    assert [x["name"] for x in m["config"]["methods"]] == ["memagent"]


def test_a_second_process_cannot_run_into_a_locked_folder(tmp_path, monkeypatch):
    import subprocess
    import sys

    cfg = _config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.jsonl").write_text('{"method": "direct", "ta')  # a torn row the locked-out run must not cut
    holder = subprocess.Popen(  # another `memagent eval`, mid-run: holds the folder's lock until it dies
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); sys.stdin.read()", str(run / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        backend = ScriptedBackend(responder=responder)
        with pytest.raises(ConfigError, match=f"run folder '{run}' is locked: another memagent eval is writing to it"):
            EvalRunner(cfg, backend=backend).run()
        assert not backend.calls and sorted(p.name for p in run.iterdir()) == [".lock", "results.jsonl"]
        assert (run / "results.jsonl").read_text() == '{"method": "direct", "ta'
    finally:
        holder.kill()  # a killed holder releases the lock
        holder.wait()
        holder.stdout.close()
        holder.stdin.close()
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run())
    assert len(rows) == 16 and len((run / "results.jsonl").read_text().splitlines()) == 16

    import fcntl

    with open(run / ".lock", "a") as f:  # held in this process, through another open file: refused too ...
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match="is locked"):
            EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
        monkeypatch.setitem(sys.modules, "fcntl", None)  # ... but without fcntl (not POSIX) there is no lock
        logs = []
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder), log=logs.append).run()
        assert "[direct | toy | 200] 4 done, 0 to run" in logs


def test_the_lock_is_released_when_a_run_ends_or_fails(tmp_path):
    import fcntl

    cfg = _config(tmp_path)
    with pytest.raises(Killed):
        EvalRunner(cfg, backend=ScriptedBackend(responder=lambda r: (_ for _ in ()).throw(Killed()))).run()
    with open(tmp_path / "run" / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again after the failed run
        fcntl.flock(f, fcntl.LOCK_UN)
    EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    with open(tmp_path / "run" / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and after a finished one


def test_malformed_middle_row_is_named_on_resume(tmp_path):
    from memagent.errors import DataError

    p = tmp_path / "results.jsonl"
    good = {"method": "m", "task": "t", "length": 1, "sample_id": "a", "status": "ok"}
    p.write_text("not json\n" + json.dumps(good) + "\n")
    with pytest.raises(DataError, match=r"results.jsonl:1: malformed result row"):
        ResultWriter(p)


def test_resume_with_other_data_settings_is_refused(tmp_path):
    cfg = _config(tmp_path)
    EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only=[("toy", 100)])
    task = cfg.tasks[0]
    changes = [
        (replace(cfg, tasks=(replace(task, metrics=("f1",)),)), r"task 'toy' metrics \[\] -> \['f1'\]"),
        (replace(cfg, tasks=(replace(task, samples=2),)), "samples 4 -> 2 .samples may grow, not shrink"),
    ]
    for changed, message in changes:
        with pytest.raises(ConfigError, match=message):
            EvalRunner(changed, backend=ScriptedBackend(responder=responder)).run()
    assert len(read_results(tmp_path / "run" / "results.jsonl")) == 8  # nothing was added by the refused runs
    grown = replace(cfg, data_seed=7, tasks=(replace(task, samples=6),))  # more samples: allowed; no seed enters files
    assert len(read_results(EvalRunner(grown, backend=ScriptedBackend(responder=responder)).run())) == 16


def test_a_sample_file_changed_under_its_rows_is_refused_on_resume(tmp_path):
    """Rows record the sha256 of the sample they were made from; a files: cell whose file was rebuilt with the
    same ids (another document, or other gold answers) is refused before any row is added."""
    from memagent.data.io import read_samples
    from memagent.errors import DataError

    cfg = _config(tmp_path, tasks=[{"name": "toy", "lengths": [100], "samples": 2,
                                    "files": {100: _data(tmp_path, 100)}}])
    rows = read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run())
    assert len(rows) == 4 and all(len(r["sample_sha256"]) == 64 for r in rows)
    path = tmp_path / "toy_100.jsonl"
    original = path.read_text()
    grown = replace(cfg, tasks=(replace(cfg.tasks[0], samples=4),))
    for edit in ({"context": "another document"}, {"answers": ("Lyon",)}):
        samples = read_samples(path)
        samples[1] = replace(samples[1], **edit)
        write_samples(path, samples)
        with pytest.raises(DataError, match=r"task 'toy' length 100: sample 's1' in .*toy_100.jsonl is not the one "
                                            r"method 'memagent'.s row was made from"):
            EvalRunner(grown, backend=ScriptedBackend(responder=responder)).run()
        assert len(read_results(tmp_path / "run" / "results.jsonl")) == 4
    path.write_text(original)  # restored: the run resumes and adds the new samples
    assert len(read_results(EvalRunner(grown, backend=ScriptedBackend(responder=responder)).run())) == 8


def test_a_refused_resume_leaves_the_folder_as_it_was(tmp_path):
    """A resumed run refused before any row (a missing file, a changed sample) restores manifest.json, so putting
    the mistake right resumes; a method or task named like one with rows up to case is refused."""
    from memagent.errors import DataError

    cfg = _config(tmp_path)
    task = cfg.tasks[0]
    EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    manifest = (tmp_path / "run" / "manifest.json").read_bytes()
    missing = replace(cfg, tasks=(replace(task, lengths=(100, 200, 300), files={**task.files, 300: str(tmp_path / "no.jsonl")}),))
    with pytest.raises(DataError, match="no.jsonl"):
        EvalRunner(missing, backend=ScriptedBackend(responder=responder)).run()
    assert (tmp_path / "run" / "manifest.json").read_bytes() == manifest
    assert len(read_results(EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run())) == 16
    renamed = replace(cfg, methods=(replace(cfg.methods[0], name="MemAgent"), cfg.methods[1]))
    with pytest.raises(ConfigError, match=r"holds rows of a method named like this grid's: 'memagent' and 'MemAgent' "
                                          r"would share one trace or data file on macOS or Windows; use the name 'memagent'"):
        EvalRunner(renamed, backend=ScriptedBackend(responder=responder)).run()
    with pytest.raises(ConfigError, match=r"rows of a task named like this grid's: 'toy' and 'Toy'"):
        EvalRunner(replace(cfg, tasks=(replace(task, name="Toy"),)), backend=ScriptedBackend(responder=responder)).run()


def test_a_data_seed_is_compared_as_the_data_was_built(tmp_path, data_root):
    """Stating a family's default seed (42 for RULER) resumes a run that left it unset; another seed is refused
    for the built task, naming the seeds the data was and would be built with."""
    cfg = _ruler_config(tmp_path, ["niah_single_1"], samples=1)
    EvalRunner(cfg, backend=ScriptedBackend()).run()
    rows = read_results(tmp_path / "run" / "results.jsonl")
    assert len(rows) == 1
    assert len(read_results(EvalRunner(replace(cfg, data_seed=42), backend=ScriptedBackend()).run())) == 1
    with pytest.raises(ConfigError, match=r"task 'niah_single_1' data_seed 42 -> 0"):
        EvalRunner(replace(cfg, data_seed=0), backend=ScriptedBackend()).run()


def _ruler_config(tmp_path, tasks, samples=2, **kw):
    """A grid on the tiny built-in RULER data path: byte tokens, scripted model, lengths of a few hundred tokens."""
    d = {"name": "r", "output": str(tmp_path / "run"), "backend": {"name": "scripted"}, "tokenizer": "bytes",
         "methods": [{"name": "direct", "kind": "direct", "max_input_tokens": 4000, "max_new_tokens": 16}],
         "tasks": [{"name": t, "lengths": [2048], "samples": samples, **kw.get(t, {})} for t in tasks]}
    return EvalConfig.from_dict(d)


def test_task_left_out_of_a_resumed_run_keeps_its_settings(tmp_path, data_root):
    """A task's settings stay on record while a later run leaves it out: coming back with other metrics or fewer
    samples is refused, exactly as straight after its own run."""
    run = lambda cfg: EvalRunner(cfg, backend=ScriptedBackend()).run()
    run(_ruler_config(tmp_path, ["vt"], samples=3))
    run(_ruler_config(tmp_path, ["niah_single_1"]))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["task_settings"]["vt"] == {"unit": None, "files": {}, "metrics": [], "samples": 3,
                                               "keep_incomplete": False, "data_seed": 42}
    # a run of another task with another data seed does not change the seed vt's data was built with
    run(replace(_ruler_config(tmp_path, ["niah_single_2"]), data_seed=0))
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["task_settings"]["vt"]["data_seed"] == 42
    built = (tmp_path / "run" / "data" / "vt_2048.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"task 'vt' data_seed 42 -> 0"):  # refused before vt's data is rebuilt
        run(replace(_ruler_config(tmp_path, ["vt"], samples=4), data_seed=0))
    assert (tmp_path / "run" / "data" / "vt_2048.jsonl").read_bytes() == built
    run(_ruler_config(tmp_path, ["vt"], samples=3))  # its own grid still resumes
    with pytest.raises(ConfigError, match=r"task 'vt' metrics \[\] -> \['string_match_part'\]"):
        run(_ruler_config(tmp_path, ["vt"], samples=4, vt={"metrics": ["string_match_part"]}))
    with pytest.raises(ConfigError, match="task 'vt' samples 3 -> 2"):
        run(_ruler_config(tmp_path, ["vt"], samples=2))
    rows = read_results(tmp_path / "run" / "results.jsonl")
    assert sorted((r["task"], r["metric"]) for r in rows) == [("niah_single_1", "string_match_all")] * 2 + \
        [("niah_single_2", "string_match_all")] * 2 + [("vt", "string_match_all")] * 3


def test_rows_scored_otherwise_are_refused_without_a_manifest(tmp_path, data_root):
    run = lambda cfg: EvalRunner(cfg, backend=ScriptedBackend()).run()
    run(_ruler_config(tmp_path, ["vt"]))
    (tmp_path / "run" / "manifest.json").unlink()  # the rows themselves still say how they were scored
    with pytest.raises(ConfigError, match=r"task 'vt' rows scored with \['string_match_all'\], this config scores \['f1'\]"):
        run(_ruler_config(tmp_path, ["vt"], vt={"metrics": ["f1"]}))


def test_a_failed_first_attempt_does_not_pin_settings(tmp_path, data_root):
    """Data problems stop the run before any row; the folder the refused run made is removed (with the data it had
    built), so the corrected settings start afresh."""
    from memagent.errors import DataError

    bad = _ruler_config(tmp_path, ["vt", "niah_single_1"], samples=4, niah_single_1={"lengths": [100]})
    with pytest.raises(DataError, match="niah_single_1' at length 100 .*leaves -28 tokens for the prompt"):
        EvalRunner(bad, backend=ScriptedBackend()).run()
    assert not (tmp_path / "run").exists()  # vt's cell came first, yet nothing ran; its data went with the folder
    ok = _ruler_config(tmp_path, ["vt"], samples=2)
    assert len(read_results(EvalRunner(ok, backend=ScriptedBackend()).run())) == 2


def test_file_cells_are_checked_before_any_row(tmp_path):
    from memagent.errors import DataError

    cfg = _config(tmp_path)
    task = cfg.tasks[0]
    missing = replace(cfg, tasks=(replace(task, lengths=(100, 300)),))
    with pytest.raises(ConfigError, match=r"no file given for length 300"):
        EvalRunner(missing, backend=ScriptedBackend(responder=responder)).run()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="the file for length 200 .*empty.jsonl. holds no samples"):
        EvalRunner(replace(cfg, tasks=(replace(task, files={100: task.files[100], 200: str(empty)}),)),
                   backend=ScriptedBackend(responder=responder)).run()
    no_gold = tmp_path / "no_gold.jsonl"
    write_samples(no_gold, [Sample("x", "Q?", "doc", ("a",)), Sample("y", "Q?", "doc", ()), Sample("z", "Q?", "doc", (" ",))])
    with pytest.raises(DataError, match=r"task 'toy' length 200 \(.*no_gold.jsonl\): 2 of 3 samples have no gold "
                                        r"answers \(e.g. sample 'y'\), so every score would be 0"):
        EvalRunner(replace(cfg, tasks=(replace(task, files={100: task.files[100], 200: str(no_gold)}),)),
                   backend=ScriptedBackend(responder=responder)).run()
    assert not (tmp_path / "run").exists()  # refused before any row: nothing left behind
    logs = []
    EvalRunner(replace(cfg, tasks=(replace(task, samples=5),)), backend=ScriptedBackend(responder=responder), log=logs.append).run()
    assert logs.count("warning: task 'toy' length 100: 4 samples, fewer than samples: 5") == 1
    assert not any("were built for" in line for line in logs)  # the toy samples record no size
    # a file whose samples say they were built for another size than its key: the summary would mislabel them
    sized = tmp_path / "sized.jsonl"
    write_samples(sized, [Sample(f"s{k}", "Q?", " " if k == 1 else "doc", ("a",), {"target_tokens": t})
                          for k, t in enumerate((300, 300, 8192))])
    logs = []
    EvalRunner(replace(cfg, output=str(tmp_path / "run2"), tasks=(replace(task, lengths=(100,), files={100: str(sized)}),)),
               backend=ScriptedBackend(responder=responder), log=logs.append).run()
    assert [line for line in logs if "were built for" in line] == [
        f"warning: task 'toy' length 100: the samples of {sized} were built for target_tokens 300, 8192, so the "
        "summary labels them 100 tokens while they are not; give the file under the length it was built for"]
    assert "warning: task 'toy' length 100: 1 sample(s) have an empty context (s1): their answers come from no " \
           "document at all" in logs  # as `memagent run` warns


def test_bad_run_folders_are_named(tmp_path):
    from memagent.errors import DataError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="run folder .*afile' is a file"):
        EvalRunner(_config(tmp_path, out="afile"), backend=ScriptedBackend(responder=responder)).run()
    cfg = _config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text("{torn")
    (tmp_path / "run" / "results.jsonl").write_text(json.dumps({
        "method": "old", "task": "toy", "length": 100, "sample_id": "s0", "status": "ok", "score": 1, "scores": {}}) + "\n")
    with pytest.raises(DataError, match=r"manifest.json: not a readable manifest .*move it away"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    (tmp_path / "run" / "manifest.json").write_text("{}")
    (tmp_path / "run" / "results.jsonl").write_bytes(b'{"method": "\xff"}\n')
    with pytest.raises(DataError, match=r"results.jsonl:1: result row is not UTF-8"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()


def test_grid_values_of_the_wrong_type_are_named():
    base = {"methods": [{"name": "m"}], "tasks": [{"name": "vt", "lengths": [8]}], "backend": {"name": "scripted"}}
    bad = [
        ({"temperature": "hot"}, "config: temperature must be a number, got 'hot'"),
        ({"seed": "abc"}, "config: seed must be an integer, got 'abc'"),
        ({"data_seed": 1.5}, "config: data_seed must be an integer, got 1.5"),
        ({"backend": "name"}, "config: backend must be a mapping, got 'name'"),
        ({"tasks": [{"name": "vt", "lengths": [8], "samples": 2.5}]}, r"tasks\[0\]: samples must be an integer, got 2.5"),
        ({"methods": [{"name": "m", "chunk_tokens": 1000.7}]}, r"methods\[0\]: chunk_tokens must be an integer"),
        ({"methods": [{"name": "m", "kind": "agent"}]}, r"methods\[0\]: kind must be one of 'memory_agent', 'direct', got 'agent'"),
    ]
    for change, message in bad:
        with pytest.raises(ConfigError, match=message):
            EvalConfig.from_dict({**base, **change})
    ok = EvalConfig.from_dict({**base, "temperature": 1, "methods": [{"name": "m", "templates": "p.yaml"}]}, base="/grids")
    assert ok.temperature == 1.0 and isinstance(ok.temperature, float) and ok.methods[0].agent.templates == "/grids/p.yaml"
    hotpot = EvalConfig.from_dict({**base, "tasks": [{"name": "hotpotqa", "lengths": [10], "files": {10: "h.jsonl"}}]})
    assert hotpot.tasks[0].length_unit == "docs"  # a label in documents, like built hotpotqa cells


def test_hotpotqa_keep_incomplete_is_a_data_setting(tmp_path, data_root):
    """Questions whose context lacks a gold paragraph are left out of built hotpotqa cells; keeping them is a
    data setting a resumed run may not change (folders from before it was recorded keep working)."""
    def config(**kw):
        return EvalConfig.from_dict({
            "name": "h", "output": str(tmp_path / "run"), "backend": {"name": "scripted"}, "tokenizer": "bytes",
            "methods": [{"name": "direct", "kind": "direct", "max_input_tokens": 4000, "max_new_tokens": 16}],
            "tasks": [{"name": "hotpotqa", "lengths": [12], "samples": 12, **kw}]})

    run = lambda cfg: read_results(EvalRunner(cfg, backend=ScriptedBackend()).run())
    rows = run(config())
    assert [r["sample_id"] for r in rows] == [f"hotpotqa-{i}" for i in (*range(10), 11, 12)]  # dev 10 lacks "Kansas Song"
    with pytest.raises(ConfigError, match=r"task 'hotpotqa' keep_incomplete False -> True"):
        run(config(keep_incomplete=True))
    manifest = tmp_path / "run" / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["task_settings"]["hotpotqa"]["keep_incomplete"]  # as written before the setting existed
    manifest.write_text(json.dumps(m))
    assert len(run(config(keep_incomplete=True))) == 12  # accepted; the built data in data/ is reused
    assert json.loads(manifest.read_text())["task_settings"]["hotpotqa"]["keep_incomplete"] is True


def test_a_missing_task_file_names_the_task_and_length(tmp_path):
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "m"), "backend": {"name": "scripted"},
        "methods": [{"name": "m", "chunk_tokens": 500, "memory_tokens": 64, "final_tokens": 64}],
        "tasks": [{"name": "mine", "lengths": [1], "samples": 1, "files": {1: str(tmp_path / "nosuch.jsonl")}}],
    })
    with pytest.raises(DataError, match=r"^task 'mine', file for length 1: input file '.*nosuch\.jsonl' not found$"):
        EvalRunner(cfg, backend=ScriptedBackend()).run()


def test_a_template_file_edited_or_a_model_file_replaced_under_the_rows_is_refused(tmp_path):
    from importlib import resources

    text = resources.files("memagent.agent").joinpath("templates/default.yaml").read_text(encoding="utf-8")
    tpl = tmp_path / "tpl.yaml"
    tpl.write_text(text, encoding="utf-8")
    d = _config(tmp_path).to_dict()
    d["methods"][0]["templates"] = str(tpl)
    cfg = EvalConfig.from_dict(d)
    EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run(only=[("toy", 100)])
    rows = (tmp_path / "run" / "results.jsonl").read_bytes()
    first = json.loads((tmp_path / "run" / "manifest.json").read_text())["prompt_hashes"]["memagent"]
    tpl.write_text(text.replace("No previous memory", "Nothing yet"), encoding="utf-8")  # same path, other prompts
    with pytest.raises(ConfigError, match=r"rows of method 'memagent' made with other prompts \(prompt hash "
                                          rf"{first} -> [0-9a-f]{{12}}: the prompt templates .*tpl.yaml' read otherwise"):
        EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    assert (tmp_path / "run" / "results.jsonl").read_bytes() == rows  # nothing added: the cell is not mixed
    tpl.write_text(text, encoding="utf-8")  # restored: the run resumes
    EvalRunner(cfg, backend=ScriptedBackend(responder=responder)).run()
    assert len(read_results(tmp_path / "run" / "results.jsonl")) == 16

    # a backend that loads a model file (llama.cpp, hf, vllm): another file under the same path is refused
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights one")
    cfg2 = _config(tmp_path, out="run2")

    def backend():
        b = ScriptedBackend(responder=responder)
        b.model_path = str(model)
        return b

    EvalRunner(cfg2, backend=backend()).run(only=[("toy", 100)])
    m = json.loads((tmp_path / "run2" / "manifest.json").read_text())
    import hashlib

    assert m["model_hashes"] == {"memagent": hashlib.sha256(b"weights one").hexdigest(),
                                 "direct": hashlib.sha256(b"weights one").hexdigest()}
    model.write_bytes(b"weights two")
    with pytest.raises(ConfigError, match=r"rows of method 'memagent' made with another model under the same path"):
        EvalRunner(cfg2, backend=backend()).run()
    model.write_bytes(b"weights one")
    EvalRunner(cfg2, backend=backend()).run()
    assert len(read_results(tmp_path / "run2" / "results.jsonl")) == 16


def test_a_key_given_twice_in_a_grid_file_is_refused_naming_both_lines(tmp_path):
    grid = tmp_path / "grid.yaml"
    head = "backend: {name: scripted}\nmethods:\n  - {name: m, kind: direct, max_new_tokens: 8}\n"
    grid.write_text(head + "tasks:\n  - {name: vt, lengths: [2K]}\ntasks:\n  - {name: niah_single_1, lengths: [2K]}\n")
    with pytest.raises(ConfigError, match=rf"{grid}: line 6: the key 'tasks' is given a second time \(first at line 4\)"
                       r".*every task under one tasks: list\)$"):
        EvalConfig.from_yaml(grid)  # PyYAML kept the second block only: vt was silently never run
    grid.write_text("backend: {name: scripted}\nmethods:\n  - {name: m, kind: memory_agent, chunk_tokens: 1000,\n"
                    "     memory_tokens: 64, chunk_tokens: 500}\ntasks:\n  - {name: vt, lengths: [2K]}\n")
    with pytest.raises(ConfigError, match=r"line 4: the key 'chunk_tokens' is given a second time \(first at line 3\)"
                       r".*give it once$"):  # no advice about methods: and tasks: lists for a method's setting
        EvalConfig.from_yaml(grid)
    # a key merged in from an anchor may be set again beside the merge, as YAML intends
    grid.write_text("backend: {name: scripted}\nmethods:\n  - &a {name: a, kind: memory_agent, chunk_tokens: 1000}\n"
                    "  - {<<: *a, name: b, chunk_tokens: 500}\ntasks:\n  - {name: vt, lengths: [2K]}\n")
    cfg = EvalConfig.from_yaml(grid)
    assert [(m.name, m.agent.chunk_tokens) for m in cfg.methods] == [("a", 1000), ("b", 500)]


def test_a_grid_entry_missing_a_required_key_names_the_key_not_the_constructor():
    """A method without `name`, a task without `name` or `lengths` (a `files:` task too): the error names the
    missing key and what to write; it was Python's `TaskConfig.__init__() missing 1 required positional argument`."""
    task = {"name": "vt", "lengths": [8]}
    cases = [
        ({"methods": [{"chunk_tokens": 500}], "tasks": [task]},
         r"^g.yaml: methods\[0\]: missing key 'name' \(the method's label"),
        ({"methods": [{"name": "m"}], "tasks": [{"lengths": [8]}]}, r"^g.yaml: tasks\[0\]: missing key 'name' \(hotpotqa, a RULER task"),
        ({"methods": [{"name": "m"}], "tasks": [{"name": "vt"}]},
         r"^g.yaml: tasks\[0\]: missing key 'lengths' \(the sizes to evaluate, e.g. lengths: \[8K, 16K\]\)"),
        ({"methods": [{"name": "m"}], "tasks": [{"name": "mine", "files": {"2K": "a.jsonl", 4096: "b.jsonl"}}]},
         r"tasks\[0\]: missing key 'lengths' .*; with files: the lengths to run among its keys, e.g. "
         r"lengths: \[2048, 4096\]"),
    ]
    for grid, match in cases:
        with pytest.raises(ConfigError, match=match) as e:
            EvalConfig.from_dict(grid, "g.yaml")
        assert "__init__" not in str(e.value) and "positional" not in str(e.value)
