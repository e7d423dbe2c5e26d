"""End-to-end tests of `memagent run` and `memagent demo` (scripted backend; once with the embedded model)."""

import json

import pytest
from typer.testing import CliRunner

from memagent.cli import app

runner = CliRunner()


def _run(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def test_run_single_document_scripted(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("first line of the document\nsecond line\n" * 3)
    trace = tmp_path / "trace.jsonl"
    r = _run("run", "-q", "What?", "-d", str(doc), "-b", "scripted", "--chunk-tokens", "40",
             "--memory-tokens", "200", "--final-tokens", "100", "--trace", str(trace))
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    n_bytes = len(doc.read_text().encode())
    n_chunks = -(-n_bytes // 40)
    assert [row["kind"] for row in rows] == ["update"] * n_chunks + ["final"]
    assert [row["chunk_index"] for row in rows[:-1]] == list(range(n_chunks))
    # the scripted model boxes the memory's last line; the CLI prints the extracted answer
    assert r.stdout.strip().splitlines()[-1] == rows[-1]["memory"].splitlines()[-1]


def test_run_reads_stdin(tmp_path):
    r = _run("run", "-q", "Q", "-d", "-", "-b", "scripted", "--chunk-tokens", "100", input="alpha beta\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1] == "alpha beta"


def test_run_jsonl_in_predictions_out(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [{"id": "a", "question": "q1", "context": "one two", "answers": ["two"]},
            {"id": "b", "question": "q2", "context": "x" * 300}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "preds.jsonl"
    r = _run("run", "--input", str(inp), "--output", str(out), "-b", "scripted", "--chunk-tokens", "100")
    assert r.exit_code == 0, r.output
    preds = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(p["sample_id"] for p in preds) == ["a", "b"]
    by_id = {p["sample_id"]: p for p in preds}
    assert by_id["a"]["answers"] == ["two"] and by_id["a"]["turns"] == 2 and by_id["b"]["turns"] == 4
    assert by_id["a"]["answer"] == "one two" and by_id["a"]["extraction"] == "boxed"
    assert all(p["error"] is None and len(p["prompt_hash"]) == 12 for p in preds)


def test_run_bad_inputs_give_clear_errors(tmp_path):
    r = _run("run", "-q", "Q", "-d", str(tmp_path / "missing.txt"), "-b", "scripted")
    assert r.exit_code == 2 and "is not a file" in r.output
    r = _run("run", "-q", "Q", "-b", "scripted")
    assert r.exit_code == 2 and "--document" in r.output
    r = _run("run", "-q", "Q", "-d", "-", "-b", "scripte", input="x")
    assert r.exit_code == 2 and "did you mean 'scripted'" in r.output.lower()
    r = _run("run", "-q", "Q", "-d", "-", "-b", "scripted", "--n-ctx", "7000", input="x")
    assert r.exit_code == 2 and "lower --chunk-tokens to at most 4484" in r.output


@pytest.mark.slow
def test_run_embedded_model_end_to_end(tmp_path, gguf_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour of Vellmar is guarded by a lighthouse. " * 20 + "The secret code is 4417. " +
                   "Boats arrive at dawn and leave at dusk. " * 20)
    trace = tmp_path / "trace.jsonl"
    r = _run("run", "-q", "What is the secret code?", "-d", str(doc), "--chunk-tokens", "200",
             "--memory-tokens", "48", "--final-tokens", "32", "--n-ctx", "2048", "--trace", str(trace))
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [row["kind"] for row in rows][-1] == "final" and len(rows) >= 3
    assert all(row["finish_reason"] in ("stop", "length") for row in rows)
    assert all(0 < row["completion_tokens"] <= 48 for row in rows[:-1])
    assert rows[-1]["completion_tokens"] <= 32
    assert r.stdout.strip()  # an answer was printed (a 135M model may well be wrong)


def test_demo_scripted_shows_memory_and_gold(data_root, tmp_path):
    trace = tmp_path / "demo.jsonl"
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--target-tokens", "12000",
             "--chunk-tokens", "4000", "--trace", str(trace))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.startswith("Question: Were Scott Derrickson and Ed Wood of the same nationality?")
    assert "--- memory after chunk 1/3" in out and "--- memory after chunk 3/3" in out
    assert "Gold answer: yes" in out
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [row["kind"] for row in rows] == ["update"] * 3 + ["final"]
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--target-tokens", "12000",
             "--chunk-tokens", "6000", "--trace", str(trace), "--overwrite")
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["kind"] for line in trace.read_text().splitlines()] == ["update"] * 2 + ["final"]


def test_demo_refuses_a_bad_trace_path_before_reading_and_creates_no_folder(data_root, tmp_path, monkeypatch):
    import memagent.cli as cli

    opened = []
    monkeypatch.setattr(cli, "_open_backend", lambda *a, **k: opened.append(1))
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--trace", str(tmp_path))
    assert r.exit_code == 2 and f"--trace {tmp_path} is a folder; give a file path" in r.output, r.output
    missing = tmp_path / "no" / "dir" / "t.jsonl"
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--trace", str(missing))
    assert r.exit_code == 2 and "folder" in r.output and "does not exist" in r.output, r.output
    assert opened == [] and not (tmp_path / "no").exists()
    (tmp_path / "doc.txt").write_text("x")
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--trace", str(tmp_path / "doc.txt" / "t.jsonl"))
    assert r.exit_code == 2 and f"{tmp_path / 'doc.txt'} is a file, not a folder" in r.output, r.output
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--trace", f"{tmp_path}/new/")
    assert r.exit_code == 2 and (f"--trace {tmp_path}/new/ ends with a slash, so it names a folder; give a file path, "
                                 f"e.g. --trace {tmp_path}/new/trace.jsonl") in " ".join(r.output.split()), r.output
    assert opened == [] and sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]  # no file named "new"
    kept = tmp_path / "results.jsonl"  # an earlier run's rows given as --trace by mistake
    kept.write_text('{"sample_id": "a"}\n')
    r = _run("demo", "-b", "scripted", "--data-root", str(data_root), "--trace", str(kept))
    assert r.exit_code == 2 and f"--trace {kept} already holds 19 bytes" in r.output, r.output
    assert "add --overwrite to replace it, or give another file" in " ".join(r.output.split())
    assert opened == [] and kept.read_text() == '{"sample_id": "a"}\n'


def test_a_policy_keeps_the_budgets_given_on_the_command_line_even_at_their_defaults(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("text")
    r = _run("run", "-b", "scripted", "--lora", "ruler-niah", "--chunk-tokens", "5000", "--memory-tokens", "1024",
             "-q", "Who?", "-d", str(doc))  # refused by the scripted backend, after the policy's settings are shown
    assert "policy ruler-niah: with the settings it was trained with: model=smollm2-f16, final_tokens=48, " \
           "templates=default" in r.output, r.output
    r = _run("run", "-b", "scripted", "--lora", "ruler-niah", "-q", "Who?", "-d", str(doc))
    assert "model=smollm2-f16, chunk_tokens=512, memory_tokens=64, final_tokens=48, templates=default" in r.output
    assert "warning" not in r.output
    r = _run("run", "-b", "scripted", "--lora", "ruler-niah", "--model", "smollm2", "-q", "Who?", "-d", str(doc))
    assert "warning: policy ruler-niah was trained on --model smollm2-f16; on smollm2 its adapter may score " \
           "lower" in r.output, r.output
    import os

    from memagent.backends.models import F16_GGUF, cache_dir

    r = _run("run", "-b", "scripted", "--lora", "ruler-niah", "--model", os.path.join(cache_dir(), F16_GGUF),
             "-q", "Who?", "-d", str(doc))  # the F16 copy by its path: no warning
    assert "warning" not in r.output and "policy ruler-niah" in r.output, r.output


def test_run_exit_status_1_when_a_sample_fails(tmp_path, monkeypatch):
    import memagent.cli as cli
    from memagent.backends.scripted import ScriptedBackend

    monkeypatch.setattr(cli, "open_backend",
                        lambda *a, **k: (ScriptedBackend(fail=lambda r: r.request_id.startswith("b/")), None))
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "question": "q", "context": "x"}\n{"id": "b", "question": "q", "context": "y"}\n')
    out = tmp_path / "out.jsonl"
    r = _run("run", "-i", str(inp), "-o", str(out))
    assert r.exit_code == 1
    rows = {row["sample_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert (rows["a"]["status"], rows["b"]["status"]) == ("ok", "error")
    assert rows["b"]["error"].startswith("b/chunk0: scripted failure")
    assert "2 samples, 1 failed" in r.output


def test_run_refuses_to_overwrite_input_and_bad_output_paths(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "question": "q", "context": "x"}\n')
    r = _run("run", "-i", str(inp), "-o", str(inp), "-b", "scripted")
    assert r.exit_code == 2 and "is also --input; write --output to another file" in r.output
    assert inp.read_text() == '{"id": "a", "question": "q", "context": "x"}\n'
    r = _run("run", "-i", str(inp), "-o", str(tmp_path / "no" / "such" / "dir.jsonl"), "-b", "scripted")
    assert r.exit_code == 2 and "cannot write --output" in r.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = _run("run", "-i", str(empty), "-b", "scripted")
    assert r.exit_code == 2 and "holds no samples" in r.output


def test_run_strips_byte_order_mark_and_warns_on_bad_utf8(tmp_path):
    doc = tmp_path / "bom.txt"
    doc.write_bytes("\ufeffhello world".encode("utf-8"))
    r = _run("run", "-q", "Q", "-d", str(doc), "-b", "scripted")
    assert r.exit_code == 0 and r.stdout.strip().splitlines()[-1] == "hello world"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    r = _run("run", "-q", "Q", "-d", str(bad), "-b", "scripted")
    assert r.exit_code == 0 and "not valid UTF-8" in r.output
    assert r.stdout.strip().splitlines()[-1] == "caf\ufffd au lait"


def _input(tmp_path, n=3):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{i}", "question": "q", "context": f"doc {i}"}) + "\n" for i in range(n)))
    return inp


def test_a_run_that_cannot_start_leaves_outputs_alone(tmp_path):
    inp, out = _input(tmp_path), tmp_path / "preds.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted").exit_code == 0
    before = out.read_text()
    assert len(before.splitlines()) == 3
    for bad in (["--n-ctx", "1000"], ["--templates", str(tmp_path / "missing.yaml")], ["--model", "x.gguf"]):
        r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--overwrite", *bad)
        assert r.exit_code == 2, r.output
        assert out.read_text() == before  # refused before the file was opened
    assert "--model is not used by --backend scripted" in r.output
    for flag, value in (("--concurrency", "256"), ("--api-key-env", "OPENAI_API_KEY")):  # even at their defaults
        r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--overwrite", flag, value)
        assert r.exit_code == 2 and f"{flag} is not used by --backend scripted; it applies to server requests" in r.output
        assert out.read_text() == before


def test_an_output_holding_rows_is_replaced_only_with_overwrite_and_resumed_only_over_the_same_samples(tmp_path):
    inp, out, trace = _input(tmp_path), tmp_path / "preds.jsonl", tmp_path / "t.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted").exit_code == 0
    before = out.read_text()
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted")
    assert r.exit_code == 2 and f"--output {out} already holds {len(before.encode())} bytes" in r.output, r.output
    assert "add --resume to continue that run, or --overwrite to replace the file" in " ".join(r.output.split())
    assert out.read_text() == before
    trace.write_text("{}\n")
    r = _run("run", "-i", str(inp), "-o", str(tmp_path / "new.jsonl"), "--trace", str(trace), "-b", "scripted")
    assert r.exit_code == 2 and f"--trace {trace} already holds 3 bytes" in r.output, r.output
    assert not (tmp_path / "new.jsonl").exists()
    rows = [json.loads(x) for x in before.splitlines()]
    assert all(len(r["input_sha256"]) == 64 for r in rows) and len({r["input_sha256"] for r in rows}) == 3
    # the same samples with another document for s1: --resume refuses to keep s1's old answer
    inp.write_text(inp.read_text().replace('"doc 1"', '"doc one, changed"'))
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")
    assert r.exit_code == 2 and f"{out}:2: the prediction of sample 's1' answered another question or document" in r.output
    assert out.read_text() == before
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--overwrite").exit_code == 0
    assert json.loads(out.read_text().splitlines()[1])["input_sha256"] != rows[1]["input_sha256"]
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")
    assert r.exit_code == 0 and "3 samples already in" in r.output, r.output
    for row in rows:  # rows written before input_sha256 was recorded resume as before
        del row["input_sha256"]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")
    assert r.exit_code == 0 and "3 samples already in" in r.output, r.output


def test_resume_keeps_predictions_but_takes_the_gold_answers_input_holds_now(tmp_path):
    inp, out = _input(tmp_path), tmp_path / "preds.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted").exit_code == 0
    before = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["answers"] for r in before] == [[], [], []]
    rows = [json.loads(x) for x in inp.read_text().splitlines()]
    rows[2]["answers"] = ["Paris", "paris, France"]  # a gold answer added later: the prediction still holds
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")
    assert r.exit_code == 0 and "3 samples already in" in r.output, r.output
    after = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["answers"] for r in after] == [[], [], ["Paris", "paris, France"]]
    assert [{k: v for k, v in r.items() if k != "answers"} for r in after] == [
        {k: v for k, v in r.items() if k != "answers"} for r in before]


def test_outputs_may_not_be_inputs_or_each_other(tmp_path):
    inp, doc = _input(tmp_path), tmp_path / "doc.txt"
    doc.write_text("the document")
    cases = [
        (["-i", str(inp), "-o", str(tmp_path / "p.jsonl"), "--trace", str(inp)], "--trace", "is also --input"),
        (["-q", "Q", "-d", str(doc), "--trace", str(doc)], "--trace", "is also --document"),
        (["-q", "Q", "-d", str(doc), "-o", str(doc)], "--output", "is also --document"),
        (["-i", str(inp), "-o", str(tmp_path / "same.jsonl"), "--trace", str(tmp_path / "same.jsonl")], "--trace", "is also --output"),
        (["-i", str(inp), "-o", str(tmp_path)], "--output", "is a folder"),
        (["-i", str(inp), "-o", f"{tmp_path}/preds/"], "--output", "ends with a slash, so it names a folder"),
        (["-q", "Q", "-d", str(doc), "--trace", "t/"], "--trace", "e.g. --trace t/trace.jsonl"),
    ]
    for args, flag, message in cases:
        r = _run("run", *args, "-b", "scripted")
        assert r.exit_code == 2 and flag in r.output and message in r.output, r.output
    assert doc.read_text() == "the document" and len(inp.read_text().splitlines()) == 3


def test_resume_keeps_finished_rows_and_runs_the_rest(tmp_path):
    inp, out, trace = _input(tmp_path, 4), tmp_path / "preds.jsonl", tmp_path / "trace.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--trace", str(trace)).exit_code == 0
    full = out.read_text().splitlines()
    turns = trace.read_text().splitlines()
    by_id = {i: [t for t in turns if json.loads(t)["sample_id"] == i] for i in ("s0", "s1", "s2", "s3")}
    assert all(by_id.values())
    failed = dict(json.loads(full[2]), status="error")
    out.write_text(full[0] + "\n" + json.dumps(failed) + "\n" + full[1][:40])  # s0 done, s2 failed, s1 torn by a kill
    stale = json.dumps({**json.loads(by_id["s2"][0]), "content": "a failed attempt"})
    trace.write_text("\n".join(by_id["s0"] + [stale]) + "\n" + by_id["s1"][0][:30])
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume", "--trace", str(trace))
    assert r.exit_code == 0 and "--resume: 1 samples already in" in r.output and "3 to run" in r.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["sample_id"] for x in rows] == ["s0", "s1", "s2", "s3"]  # the failed s2 row and the torn s1 row are gone
    # the trace keeps s0's turns and holds each rerun sample's turns once: no stale or torn turn is left
    def timeless(lines):
        return [{k: v for k, v in json.loads(t).items() if k != "seconds"} for t in lines]

    assert trace.read_text().splitlines()[: len(by_id["s0"])] == by_id["s0"]
    assert timeless(trace.read_text().splitlines()) == timeless(by_id["s0"] + [t for i in ("s1", "s2", "s3") for t in by_id[i]])
    def secondless(row):  # wall-clock seconds differ between the two runs
        return json.dumps({k: v for k, v in row.items() if k != "seconds"})

    assert [secondless(x) for x in rows] == [secondless(json.loads(x)) for x in sorted(full, key=lambda t: json.loads(t)["sample_id"])]
    assert rows[0]["settings"] == {"backend": "scripted", "chunk_tokens": 5000, "memory_tokens": 1024, "final_tokens": 1024,
                                   "max_context_tokens": None, "temperature": 0.0, "top_p": 1.0, "seed": 0,
                                   "templates": rows[0]["prompt_hash"], "tokenizer": "bytes"}
    out.write_text("\n".join(full[:2]) + "\n")
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume", "--memory-tokens", "300")
    assert r.exit_code == 2 and "holds rows made with other settings (memory_tokens: 1024 -> 300)" in r.output, r.output
    assert out.read_text() == "\n".join(full[:2]) + "\n"  # untouched
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume", "--tokenizer", "smollm2")
    assert r.exit_code == 2 and "(tokenizer: 'bytes' -> 'SmolLM2-135M-Instruct.Q4_1.gguf')" in r.output, r.output
    old_rows = [json.dumps({**json.loads(x), "settings": {k: v for k, v in json.loads(x)["settings"].items()
                                                          if k != "tokenizer"}}) for x in full[:2]]
    out.write_text("\n".join(old_rows) + "\n")  # rows written before the tokenizer was recorded still resume
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume").exit_code == 0
    r = _run("run", "-q", "Q", "-d", "-", "-b", "scripted", "--resume", input="x")
    assert r.exit_code == 2 and "--resume continues an --input run" in r.output


def test_kill_between_trace_and_row_loses_no_turns(tmp_path, monkeypatch):
    # a kill lands after sample s1's turns are written and before its prediction row: the resumed run must
    # redo s1 and leave each sample's turns in the trace exactly once
    import memagent.cli as cli

    inp, out, trace = _input(tmp_path, 3), tmp_path / "preds.jsonl", tmp_path / "trace.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(tmp_path / "ref.jsonl"), "-b", "scripted",
                "--trace", str(tmp_path / "ref_trace.jsonl")).exit_code == 0
    want = sorted((tmp_path / "ref_trace.jsonl").read_text().splitlines(), key=lambda t: json.loads(t)["sample_id"])
    real = cli._prediction_row

    def killed_at_s1(sample, traj, *args):
        if sample.id == "s1":
            raise KeyboardInterrupt
        return real(sample, traj, *args)

    monkeypatch.setattr(cli, "_prediction_row", killed_at_s1)
    _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--trace", str(trace))
    assert [json.loads(x)["sample_id"] for x in out.read_text().splitlines()] == ["s0"]
    assert {json.loads(x)["sample_id"] for x in trace.read_text().splitlines()} == {"s0", "s1"}
    monkeypatch.setattr(cli, "_prediction_row", real)
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--trace", str(trace), "--resume").exit_code == 0
    assert sorted(json.loads(x)["sample_id"] for x in out.read_text().splitlines()) == ["s0", "s1", "s2"]

    def timeless(lines):
        return [{k: v for k, v in json.loads(t).items() if k != "seconds"} for t in lines]

    got = sorted(trace.read_text().splitlines(), key=lambda t: json.loads(t)["sample_id"])
    assert timeless(got) == timeless(want)


def test_input_encoding_and_question_errors(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes("\ufeff".encode() + b'{"id": "a", "question": "q", "context": "x"}\n')
    assert _run("run", "-i", str(bom), "-b", "scripted").exit_code == 0
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"id": "a", "question": "q", "context": "caf\xe9"}\n')
    r = _run("run", "-i", str(latin), "-b", "scripted")
    assert r.exit_code == 2 and "latin.jsonl:1: not UTF-8 text (invalid continuation byte at byte" in r.output
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"id": "a", "question": "  ", "context": "x"}\n')
    r = _run("run", "-i", str(blank), "-b", "scripted")
    assert r.exit_code == 2 and "blank.jsonl:1: field 'question' is empty" in r.output
    (tmp_path / "dir.jsonl").mkdir()
    r = _run("run", "-i", str(tmp_path / "dir.jsonl"), "-b", "scripted")
    assert r.exit_code == 2 and "is a folder" in r.output
    r = _run("run", "-q", "Q", "-d", "-", "-b", "scripted", input=b"caf\xe9\n")
    assert r.exit_code == 0 and "stdin is not valid UTF-8" in r.output and r.stdout.strip().splitlines()[-1] == "caf\ufffd"
    r = _run("run", "-q", "Q", "-d", "-", "-b", "scripted", input="")
    assert r.exit_code == 0 and "the document (stdin) is empty" in r.output


def test_single_question_with_a_failed_request_exits_1(tmp_path, monkeypatch):
    import memagent.cli as cli
    from memagent.backends.scripted import ScriptedBackend

    monkeypatch.setattr(cli, "open_backend", lambda *a, **k: (ScriptedBackend(fail=lambda r: r.request_id.endswith("final")), None))
    r = _run("run", "-q", "Q", "-d", "-", input="text")
    assert r.exit_code == 1 and "error: 0/final: scripted failure" in r.output


def test_resume_refuses_an_output_that_is_not_predictions_of_these_samples(tmp_path):
    inp, out, trace = _input(tmp_path, 4), tmp_path / "preds.jsonl", tmp_path / "trace.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--trace", str(trace)).exit_code == 0
    samples_copy = tmp_path / "samples_copy.jsonl"
    samples_copy.write_text(inp.read_text())
    other = tmp_path / "other.jsonl"  # two samples whose ids the predictions file does not hold
    other.write_text("".join(json.dumps({"id": f"x{i}", "question": "q", "context": "c"}) + "\n" for i in range(2)))
    cases = [(inp, trace, "trace.jsonl:1: not a predictions row"),
             (inp, samples_copy, "samples_copy.jsonl:1: not a predictions row"),
             (other, out, "preds.jsonl:1: a prediction of sample 's0', which --input does not hold")]
    for samples, target, message in cases:
        before = target.read_bytes()
        r = _run("run", "-i", str(samples), "-o", str(target), "-b", "scripted", "--resume")
        assert r.exit_code == 2 and message in r.output and "leaves any other file untouched" in r.output, r.output
        assert target.read_bytes() == before  # nothing rewritten


def test_run_holds_a_lock_on_its_output_so_a_second_resume_exits_2(tmp_path):
    from memagent.runfiles import output_lock

    inp, out = _input(tmp_path, 4), tmp_path / "preds.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted").exit_code == 0
    before = out.read_bytes()
    with output_lock(out):  # another process writing into it (flock conflicts across open files, in one process too)
        r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")
    assert r.exit_code == 2 and "is locked: another memagent run is writing to it" in r.output, r.output
    assert out.read_bytes() == before
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")  # released: runs (nothing left)
    assert r.exit_code == 0 and "4 samples already in" in r.output and out.read_bytes() == before, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "preds.jsonl"]  # no .preds.jsonl.lock left


def test_demo_ruler_marks_the_needle_chunk_and_tests_each_memory_for_the_answer(data_root, tmp_path):
    from memagent.chunking import chunk_text
    from memagent.data.ruler import build_ruler_sample
    from memagent.tokenization import load_tokenizer

    sample = build_ruler_sample("niah_single_2", 2048, 0, load_tokenizer("bytes"), data_root=str(data_root))
    chunks = chunk_text(sample.context, load_tokenizer("bytes"), 400)
    needle_at = sample.metadata["evidence"][0]["start_char"]
    k = next(c.index for c in chunks if c.start_char <= needle_at < c.end_char)
    r = _run("demo", "-b", "scripted", "--ruler", "niah_single_2", "--target-tokens", "2048", "--chunk-tokens", "400",
             "--data-root", str(data_root), "--trace", str(tmp_path / "t.jsonl"))
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert f"-> {len(chunks)} chunks of <= 400 tokens" in out
    assert f"--- memory after chunk {k + 1}/{len(chunks)}   <- the needle is in this chunk" in out
    assert out.count("<- the needle is in this chunk") == 1
    assert "[untrained] (holds the answer)" not in out  # the scripted memory keeps first lines, not the needle
    assert out.rstrip().endswith(f"gold: {sample.answers[0]}")
    # each column's turns carry its name, so a trained column beside it reads as another sample, not as one interleaved
    turns = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {t["sample_id"] for t in turns} == {f"{sample.id}@untrained"} and len(turns) == len(chunks) + 1


def test_demo_ruler_interrupted_in_the_trained_column_keeps_the_untrained_one(data_root, tmp_path, monkeypatch):
    """Ctrl-C while the trained model loads or reads: the untrained column already read goes to --trace (it was
    lost: only a MemagentError kept it), then the interrupt goes on."""
    import dataclasses

    import memagent.cli as cli
    from memagent.agent.config import AgentConfig
    from memagent.backends.factory import BackendOptions
    from memagent.backends.scripted import ScriptedBackend

    @dataclasses.dataclass(frozen=True)
    class Options(BackendOptions):
        def settings(self):  # a scripted backend takes no adapter; this test only needs two columns
            return None

    opened = []

    def fake_open(options, check_reachable=True):
        opened.append(options.lora_path)
        if options.lora_path:
            raise KeyboardInterrupt
        return ScriptedBackend(), None

    monkeypatch.setattr(cli, "_open_backend", fake_open)
    trace = tmp_path / "t.jsonl"
    options = Options(backend="scripted", model="m", lora_path="adapter.gguf")
    with pytest.raises(KeyboardInterrupt):
        cli._demo_ruler("niah_single_2", 2048, 0, data_root, trace, AgentConfig(chunk_tokens=400), options)
    assert opened == [None, "adapter.gguf"]
    turns = [json.loads(x) for x in trace.read_text().splitlines()]
    assert {t["sample_id"] for t in turns} == {"niah_single_2-2048-0@untrained"} and len(turns) == 5 + 1  # 5 chunks + final


def test_ctrl_c_during_an_input_run_says_what_is_kept_and_how_to_go_on(tmp_path, monkeypatch):
    from memagent.agent.loop import MemoryAgent

    real_run = MemoryAgent.run

    def interrupted(self, samples, on_result=None, **kw):  # the first sample answered, then Ctrl-C
        real_run(self, samples[:1], on_result=on_result)
        raise KeyboardInterrupt

    inp, out = _input(tmp_path, 4), tmp_path / "preds.jsonl"
    monkeypatch.setattr(MemoryAgent, "run", interrupted)
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted")
    assert r.exit_code != 0
    assert f"interrupted: 1 of 4 samples answered in this run are in {out}; rerun the same command with --resume" \
        in r.output, r.output
    assert len(out.read_text().splitlines()) == 1
    monkeypatch.undo()
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume")
    assert r.exit_code == 0 and "1 samples already in" in r.output and len(out.read_text().splitlines()) == 4


def test_run_lora_of_an_unknown_policy_name_exits_2_listing_the_packaged_ones(tmp_path):
    r = _run("run", "-q", "Q", "-d", "-", "--lora", "ruler-naih", "-b", "llamacpp", input="text")
    assert r.exit_code == 2 and "no packaged policy 'ruler-naih'" in r.output, r.output


def test_samples_with_an_empty_context_are_warned_about_and_answered(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "a", "question": "q", "context": "doc"}, {"id": "b", "question": "q", "context": " \n"},
            {"id": "c", "question": "q", "context": ""}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted")
    assert r.exit_code == 0, r.output
    assert f"warning: 2 sample(s) of {inp} have an empty context (b, c)" in r.output
    assert sorted(json.loads(x)["sample_id"] for x in out.read_text().splitlines()) == ["a", "b", "c"]  # written as done


def test_run_settings_identify_model_and_adapter_files_by_content_not_spelling(tmp_path, monkeypatch):
    """The rows' settings (compared by --resume): model_sha256 and lora_sha256 beside the backend's name, whose
    adapter path as typed is left out once the adapter's bytes identify it."""
    import hashlib
    import os
    import types

    from memagent.agent.loop import MemoryAgent
    from memagent.backends.scripted import ScriptedBackend
    from memagent.cli import _run_settings

    model, adapter = tmp_path / "m.gguf", tmp_path / "a.gguf"
    model.write_bytes(b"weights")
    adapter.write_bytes(b"adapter")
    agent = MemoryAgent(ScriptedBackend())
    monkeypatch.chdir(tmp_path)
    b = types.SimpleNamespace(name="llamacpp:m.gguf+lora:./a.gguf", model_path=str(model))
    one = _run_settings(b, agent, "./a.gguf")
    assert one["backend"] == "llamacpp:m.gguf+lora"
    assert one["model_sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert one["lora_sha256"] == hashlib.sha256(b"adapter").hexdigest()
    b2 = types.SimpleNamespace(name=f"llamacpp:m.gguf+lora:{adapter}", model_path=str(model))
    assert _run_settings(b2, agent, str(adapter)) == one  # another spelling of the same adapter
    model.write_bytes(b"other weights")
    os.utime(model, ns=(1, 1))  # even with an old mtime, the size differs
    assert _run_settings(b, agent, "./a.gguf")["model_sha256"] == hashlib.sha256(b"other weights").hexdigest()
    plain = _run_settings(types.SimpleNamespace(name="scripted"), agent)
    assert "model_sha256" not in plain and "lora_sha256" not in plain and plain["backend"] == "scripted"


def test_resume_refuses_a_trace_file_that_is_not_this_runs_and_overwrite_excludes_resume(tmp_path):
    inp, out, trace = _input(tmp_path), tmp_path / "preds.jsonl", tmp_path / "t.jsonl"
    assert _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted").exit_code == 0
    samples_copy = inp.read_text()
    trace.write_text(samples_copy)  # the samples file given as --trace by mistake
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume", "--trace", str(trace))
    assert r.exit_code == 2 and f"{trace}:1: not a trace turn" in r.output, r.output
    other = '{"sample_id": "z1", "turn": 0, "kind": "update", "memory": "m"}\n'
    trace.write_text(other)  # another run's trace
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume", "--trace", str(trace))
    assert r.exit_code == 2 and "a turn of sample 'z1', which --input does not hold" in r.output, r.output
    assert trace.read_text() == other
    r = _run("run", "-i", str(inp), "-o", str(out), "-b", "scripted", "--resume", "--overwrite")
    assert r.exit_code == 2 and "--resume keeps the rows --output holds and --overwrite replaces them; give one" in r.output
    doc = tmp_path / "doc.txt"
    doc.write_text("the document")
    assert _run("run", "-q", "Q?", "-d", str(doc), "-b", "scripted", "--trace", str(tmp_path / "one.jsonl")).exit_code == 0
    r = _run("run", "-q", "Q?", "-d", str(doc), "-b", "scripted", "--trace", str(tmp_path / "one.jsonl"))
    assert r.exit_code == 2 and "add --overwrite to replace it, or give another file" in " ".join(r.output.split())
    assert "--resume" not in r.output  # it does not apply to --question/--document


def test_input_samples_from_stdin(tmp_path):
    inp, out = _input(tmp_path), tmp_path / "preds.jsonl"
    r = CliRunner().invoke(app, ["run", "-i", "-", "-o", str(out), "-b", "scripted"], input=inp.read_text())
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["sample_id"] for x in out.read_text().splitlines()] == ["s0", "s1", "s2"]


def test_a_full_disk_mid_run_is_named_and_the_rows_written_stay_for_resume(tmp_path, monkeypatch):
    """The disk fills (or a file size limit is hit) while rows are written: exit 2 naming the option, the file
    and the system's reason, and how to go on; the rows on disk stay and --resume completes them. It was an
    OSError traceback (exit 1)."""
    import errno

    from memagent.runfiles import jsonl

    inp, out, trace = _input(tmp_path, 4), tmp_path / "preds.jsonl", tmp_path / "trace.jsonl"
    real = jsonl.JsonlWriter.write_many

    def fills_up(self, rows):
        if self.path == trace and len(trace.read_text().splitlines()) >= 4:  # two samples' turns fit
            self._f.write('{"torn')  # part of a row reaches the disk
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, rows)

    monkeypatch.setattr(jsonl.JsonlWriter, "write_many", fills_up)
    r = _run("run", "-i", str(inp), "-o", str(out), "--trace", str(trace), "-b", "scripted", "--batch-size", "1")
    assert r.exit_code == 2, r.output
    assert f"cannot write --trace {trace}: No space left on device" in r.output
    assert "--resume" in r.output and "Traceback" not in r.output
    assert [json.loads(x)["sample_id"] for x in out.read_text().splitlines()] == ["s0", "s1"]
    monkeypatch.setattr(jsonl.JsonlWriter, "write_many", real)
    r = _run("run", "-i", str(inp), "-o", str(out), "--trace", str(trace), "-b", "scripted", "--resume")
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(x)["sample_id"] for x in out.read_text().splitlines()) == ["s0", "s1", "s2", "s3"]
    assert [json.loads(x)["sample_id"] for x in trace.read_text().splitlines()] == ["s0", "s0", "s1", "s1", "s2", "s2",
                                                                                      "s3", "s3"]


def test_an_empty_document_path_is_named_as_such():
    """`-d ""` (an unset shell variable): since documents go through a Path, the error named the working directory
    (`. is not a file`)."""
    r = _run("run", "-q", "What?", "-d", "", "-b", "scripted")
    assert r.exit_code == 2 and "--document is an empty path" in r.output, r.output


def test_a_document_from_a_pipe_is_read_as_stdin_is(tmp_path):
    """`-d <(zcat doc.txt.gz)` (a named pipe, as `-i <(cat rows.jsonl)` already was): read once, in pieces, as
    `-d -` reads stdin; it was refused as "not a file"."""
    import os
    import subprocess
    import time

    doc = tmp_path / "doc.txt"
    doc.write_text("first line of the document\nsecond line\n" * 3)
    want = _run("run", "-q", "What?", "-d", str(doc), "-b", "scripted", "--chunk-tokens", "40",
                "--trace", str(tmp_path / "want.jsonl"))
    assert want.exit_code == 0, want.output
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", 'cat "$0" > "$1"', str(doc), str(fifo)])  # as a shell's <(cat doc.txt)
    try:
        r = _run("run", "-q", "What?", "-d", str(fifo), "-b", "scripted", "--chunk-tokens", "40",
                 "--trace", str(tmp_path / "got.jsonl"))
    finally:
        if writer.poll() is None:  # the run did not open the pipe: let the writer finish
            time.sleep(0.2)
            if writer.poll() is None:
                fifo.read_bytes()
        writer.wait(timeout=10)
    assert r.exit_code == 0, r.output
    assert r.stdout == want.stdout

    def timeless(p):
        return [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in p.read_text().splitlines()]

    assert timeless(tmp_path / "got.jsonl") == timeless(tmp_path / "want.jsonl")
