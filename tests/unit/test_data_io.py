"""Sample contract, readers/writers, reference layouts, data-root resolution."""

import json

import pytest

from memagent.data import paths
from memagent.data.io import read_samples, samples_from_hf, write_samples
from memagent.data.schema import render_documents, sample_from_reference, token_stats
from memagent.errors import DataError
from memagent.types import Sample

SAMPLES = [
    Sample("a", "Who?", "Some text.", ("Ann", "Anne"), {"length_tokens": 3, "tokenizer": "bytes"}),
    Sample("b", "Where? {memory}", "ünïcode \\boxed{x}", (), {}),
]


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet"])
def test_round_trip(tmp_path, ext):
    p = tmp_path / f"s.{ext}"
    write_samples(p, SAMPLES)
    back = read_samples(p)
    assert back == SAMPLES
    assert back[0].metadata == {"length_tokens": 3, "tokenizer": "bytes"}
    assert not (tmp_path / f"s.{ext}.tmp").exists()


def test_jsonl_errors_name_file_line_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "1", "question": "q", "context": "c"}\n\n{"id": "2", "context": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: .*'question'"):
        read_samples(p)
    p.write_text('{"id": "1", "question": "q", "context": "c", "answers": [1]}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: field 'answers' must be a string or a list of strings, got"):
        read_samples(p)
    p.write_text('{"id": "1", "question": "q"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: invalid JSON"):
        read_samples(p)
    p.write_text('{"id": "1", "question": "q", "context": "c"}\n{"id": "1", "question": "q", "context": "d"}\n')
    with pytest.raises(DataError, match="duplicate sample id '1'"):
        read_samples(p)
    with pytest.raises(DataError, match="not found"):
        read_samples(tmp_path / "missing.jsonl")
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(DataError, match=r"unknown file type; use one of .jsonl, .json, .parquet \(or .ndjson; '-'"):
        read_samples(tmp_path / "x.txt")
    rows = '{"id": "1", "question": "q", "context": "c"}\n'
    for name in ("UP.JSONL", "x.ndjson"):  # any case; .ndjson is JSON lines
        (tmp_path / name).write_text(rows)
        assert [s.id for s in read_samples(tmp_path / name)] == ["1"]
    (tmp_path / "garbage.parquet").write_text("not parquet at all")
    with pytest.raises(DataError, match=r"garbage\.parquet: not a readable parquet file \("):
        read_samples(tmp_path / "garbage.parquet")
    for bad_id in ("true", '""', '"  "'):
        p.write_text('{"id": %s, "question": "q", "context": "c"}\n' % bad_id)
        with pytest.raises(DataError, match=r"bad\.jsonl:1: field 'id' must be a non-empty string or an integer"):
            read_samples(p)
    for bad_meta in ("[]", "0", '""', "false"):
        p.write_text('{"id": 1, "question": "q", "context": "c", "metadata": %s}\n' % bad_meta)
        with pytest.raises(DataError, match=r"bad\.jsonl:1: field 'metadata' "):
            read_samples(p)
    p.write_text('{"id": 1, "question": "q", "context": "c", "metadata": null}\n')
    assert read_samples(p)[0].metadata == {}


def test_documents_field_and_optional_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"id": 7, "question": "q", "documents": ["T1\nx", "T2\ny"]}) + "\n")
    (s,) = read_samples(p)
    assert s.id == "7" and s.answers == () and s.metadata == {}
    assert s.context == "Document 1:\nT1\nx\n\nDocument 2:\nT2\ny"
    assert render_documents([]) == ""
    p.write_text(json.dumps({"id": 8, "question": "q", "context": "c", "answer": "Kansas Song"}) + "\n")
    assert read_samples(p)[0].answers == ("Kansas Song",)  # HotpotQA's own key
    p.write_text(json.dumps({"id": 8, "question": "q", "context": "c", "answer": "a", "answers": ["a"]}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: give the gold answers in one field, 'answers' \(a list\) or 'answer', not both"):
        read_samples(p)


def test_reference_layouts(tmp_path):
    hqa = [{"context": "Document 1:\nA\nb", "input": "Q1", "answers": ["x"], "num_docs": 50, "index": 12}]
    p = tmp_path / "eval_50.json"
    p.write_text(json.dumps(hqa))
    (s,) = read_samples(p)
    assert (s.id, s.question, s.context, s.answers, s.metadata["num_docs"]) == ("12", "Q1", "Document 1:\nA\nb", ("x",), 50)

    ruler = {"index": 3, "input": "Find it.", "context": "hay", "outputs": ["1", "2"], "answer_prefix": "A:", "length": 8000}
    s = sample_from_reference(ruler, "f[0]")
    assert s.answers == ("1", "2") and s.metadata["reference_length_tokens"] == 8000
    # a whole reference RULER file: written in chunks of 16 whose index restarts at 0, keyed by position
    rows = [dict(ruler, index=i % 16, context=f"hay {k}") for k, i in enumerate(range(40))]
    (tmp_path / "eval_niah_single_2_8192.json").write_text(json.dumps(rows))
    got = read_samples(tmp_path / "eval_niah_single_2_8192.json")
    assert [x.id for x in got] == [str(k) for k in range(40)] and got[17].context == "hay 17"
    assert [x.metadata["index"] for x in got[14:18]] == [14, 15, 0, 1]
    assert [x.id for x in read_samples(tmp_path / "eval_niah_single_2_8192.json", limit=3)] == ["0", "1", "2"]

    big = dict(hqa[0], context=[1, 2, 3])
    with pytest.raises(DataError, match=r"f\[0\]: field 'context' holds document indices"):
        sample_from_reference(big, "f[0]")

    train = {
        "data_source": "hotpotqa",
        "prompt": [{"role": "user", "content": "Q?"}],
        "context": "ctx",
        "ability": "memory",
        "reward_model": {"style": "rule", "ground_truth": ["g"]},
        "extra_info": {"index": 5, "question": "Q?", "num_docs": 200},
    }
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([train]), tmp_path / "train.parquet")
    (s,) = read_samples(tmp_path / "train.parquet")
    assert (s.id, s.question, s.context, s.answers, s.metadata["num_docs"]) == ("5", "Q?", "ctx", ("g",), 200)

    with pytest.raises(DataError, match="unknown record layout"):
        sample_from_reference({"foo": 1}, "x")


def test_hf_rows():
    hotpot = {
        "id": "h1",
        "question": "q",
        "answer": "a",
        "type": "bridge",
        "level": "hard",
        "context": {"title": ["T1", "T2"], "sentences": [["s1. ", "s2."], ["u."]]},
    }
    squad = {"id": "s1", "title": "X", "context": "para", "question": "q2", "answers": {"text": ["p", "pa"], "answer_start": [0, 0]}}
    a, b = samples_from_hf([hotpot, squad])
    assert a.context == "Document 1:\nT1\ns1. s2.\n\nDocument 2:\nT2\nu." and a.answers == ("a",)
    assert b.answers == ("p", "pa") and b.context == "para"
    with pytest.raises(DataError, match="dataset row 0"):
        samples_from_hf([{"x": 1}])


def test_files_in_the_datasets_and_official_layouts_are_read(tmp_path):
    """`run --input` and eval files: HF `datasets` exports of HotpotQA and SQuAD (JSON Lines and parquet) and the
    official HotpotQA JSON list read as samples (they were refused: 'context' must be str, 'answers' must be a
    list of strings, missing field 'id')."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hotpot = {"id": "h1", "question": "q", "answer": "a", "type": "bridge", "level": "hard",
              "context": {"title": ["T1", "T2"], "sentences": [["s1. ", "s2."], ["u."]]},
              "supporting_facts": {"title": ["T1"], "sent_id": [0]}}
    squad = {"id": "s1", "title": "X", "context": "para", "question": "q2",
             "answers": {"text": ["p", "pa"], "answer_start": [0, 0]}}
    unanswerable = dict(squad, id="s2", answers={"text": [], "answer_start": []})
    (tmp_path / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (hotpot, squad, unanswerable)))
    pq.write_table(pa.Table.from_pylist([hotpot]), tmp_path / "hotpot.parquet")
    pq.write_table(pa.Table.from_pylist([squad, unanswerable]), tmp_path / "squad.parquet")
    official = [{"_id": "5a8b", "question": "q", "answer": "a", "type": "bridge", "level": "hard",
                 "supporting_facts": [["T1", 0]], "context": [["T1", ["s1. ", "s2."]], ["T2", ["u."]]]}]
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(official))
    doc = "Document 1:\nT1\ns1. s2.\n\nDocument 2:\nT2\nu."
    a, b, c = read_samples(tmp_path / "hf.jsonl")
    assert (a.id, a.context, a.answers, b.context, b.answers, c.answers) == ("h1", doc, ("a",), "para", ("p", "pa"), ())
    (h,) = read_samples(tmp_path / "hotpot.parquet")
    assert (h.id, h.context, h.answers) == ("h1", doc, ("a",))
    assert [(x.id, x.answers) for x in read_samples(tmp_path / "squad.parquet")] == [("s1", ("p", "pa")), ("s2", ())]
    (o,) = read_samples(tmp_path / "hotpot_dev_distractor_v1.json")
    assert (o.id, o.question, o.context, o.answers) == ("5a8b", "q", doc, ("a",))
    # Dataset.to_json("x.json") writes JSON Lines: read as such (it failed with "Extra data at line 2")
    (tmp_path / "export.json").write_text((tmp_path / "hf.jsonl").read_text())
    assert [x.id for x in read_samples(tmp_path / "export.json")] == ["h1", "s1", "s2"]
    (tmp_path / "one.json").write_text(json.dumps(squad) + "\n")  # a one-row export: one object, one sample
    assert [x.id for x in read_samples(tmp_path / "one.json")] == ["s1"]
    (tmp_path / "export.json").write_text(json.dumps(squad) + "\n{broken\n")
    with pytest.raises(DataError, match=r"export.json:2: invalid JSON"):
        read_samples(tmp_path / "export.json")
    (tmp_path / "dev-v2.0.json").write_text(json.dumps({"version": "v2.0", "data": [{"title": "X", "paragraphs": []}]}))
    with pytest.raises(DataError, match=r"dev-v2.0.json: this is the official SQuAD JSON .*load_squad"):
        read_samples(tmp_path / "dev-v2.0.json")
    for bad, message in [(dict(hotpot, answer=1990), r"bad.jsonl:1: field 'answer' must be a string, got 1990"),
                         (dict(hotpot, context={"title": ["T1"], "sentences": []}), r"field 'context' must be \{title"),
                         ({k: v for k, v in hotpot.items() if k != "id"}, r"missing field 'id'"),
                         (dict(squad, answers={"text": [1]}), r"field 'answers.text' must be a string or a list")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(DataError, match=message):
            read_samples(tmp_path / "bad.jsonl")


def test_token_stats():
    assert token_stats([3, 5, 10]) == {"n": 3, "mean": 6.0, "min": 3, "max": 10}
    assert token_stats([])["n"] == 0


def test_data_root_order(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.setenv(paths.ENV_VAR, str(b))
    assert paths.data_root(a) == a  # explicit wins
    assert paths.data_root() == b  # then the environment
    monkeypatch.setenv(paths.ENV_VAR, str(tmp_path / "nope"))
    with pytest.raises(DataError, match="MEMAGENT_DATA"):
        paths.data_root()
    with pytest.raises(DataError, match="--data-root"):
        paths.data_root(tmp_path / "nope")
    monkeypatch.delenv(paths.ENV_VAR)
    monkeypatch.setattr(paths, "_repo_default", lambda: tmp_path / "absent")
    with pytest.raises(DataError, match="MEMAGENT_DATA=DIR"):
        paths.data_root()
    monkeypatch.setattr(paths, "_repo_default", lambda: a)
    assert paths.data_root() == a
    with pytest.raises(DataError, match="not found under the data root"):
        paths.data_file("x/y.json")


def test_sample_answers_must_be_strings_in_a_sequence():
    from memagent.types import Sample

    assert Sample("a", "q", "doc", ["Paris", "paris"]).answers == ("Paris", "paris")
    with pytest.raises(TypeError, match=r"answers=\('Paris',\)"):
        Sample("a", "q", "doc", "Paris")
    with pytest.raises(TypeError, match="answers must be strings"):
        Sample("a", "q", "doc", (1934,))


def test_a_lone_surrogate_is_refused_at_read_time_with_file_line_and_field(tmp_path):
    """JSON's "\\ud800" escape without its pair decodes to a code point no tokenizer can encode (issue 17, item 3)."""
    good = '{"id": "a", "question": "q", "context": "fine"}\n'
    p = tmp_path / "s.jsonl"
    p.write_text(good + '{"id": "b", "question": "q", "context": "bad \\ud800 text"}\n')
    with pytest.raises(DataError, match=r"s\.jsonl:2: field 'context' holds a lone surrogate U\+D800 at character 4"):
        read_samples(p)
    p.write_text(good + '{"id": "b", "question": "q", "context": "c", "metadata": {"k": ["x", "\\udfff"]}}\n')
    with pytest.raises(DataError, match=r"s\.jsonl:2: field 'metadata\.k\[1\]' holds a lone surrogate U\+DFFF"):
        read_samples(p)
    j = tmp_path / "s.json"
    j.write_text('[{"id": "a", "question": "q\\udc80?", "context": "c"}]')
    with pytest.raises(DataError, match=r"s\.json\[0\]: field 'question' holds a lone surrogate U\+DC80 at character 1"):
        read_samples(j)
    # a surrogate pair is one character (an emoji); a backslash-escaped "\\ud800" is plain text
    p.write_text('{"id": "a", "question": "q", "context": "\\ud83d\\ude00 and \\\\ud800"}\n')
    assert read_samples(p)[0].context == "\U0001F600 and \\ud800"


def test_json_readers_turn_every_parse_failure_into_a_data_error(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text("[" * 100_000 + "\n")  # nested too deeply for the parser
    with pytest.raises(DataError, match=r"s\.jsonl:1: invalid JSON \(arrays or objects nested too deeply\)"):
        read_samples(p)
    p.write_text('{"id": ' + "1" * 5000 + "}\n")  # an integer above Python's 4,300-digit limit
    with pytest.raises(DataError, match=r"s\.jsonl:1: invalid JSON \(Exceeds the limit"):
        read_samples(p)
    p.write_bytes('{"id": "a", "question": "q", "context": "c"}\n'.encode("utf-16"))
    with pytest.raises(DataError, match=r"s\.jsonl:1: the file is UTF-16 .*iconv -f utf-16 -t utf-8"):
        read_samples(p)
    j = tmp_path / "s.json"
    j.write_text('[\n{"id": "a",\n "question": }]')
    with pytest.raises(DataError, match=r"s\.json: invalid JSON \(Expecting value at line 3 column 14\)"):
        read_samples(j)


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be", "utf-8-sig"])
def test_a_document_with_a_byte_order_mark_is_decoded_by_it(codec):
    """UTF-16 text with a BOM was read as garbled UTF-8 with only a warning (issue 17, item 10)."""
    from memagent.data.io import read_document_text

    text = "Grüße, 世界 😀\nline two"
    raw = text.encode(codec)
    if not codec.startswith("utf-8") and codec[-2:] in ("le", "be"):  # these codecs write no mark: add it
        raw = "\ufeff".encode(codec) + raw
    assert read_document_text(raw, "doc", warn=pytest.fail) == text


def test_binary_documents_are_refused_unless_allowed(tmp_path):
    from memagent.data.io import read_document_text

    png = tmp_path / "img.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    with pytest.raises(DataError, match=r"img\.png looks like a binary file, not text \(it holds NUL bytes \(the first "
                                         r"at byte 8\).*pass --allow-binary"):
        read_document_text(png)
    warned = []
    text = read_document_text(png, allow_binary=True, warn=warned.append)
    assert text.startswith("\ufffdPNG\r\n\x1a\n\x00") and "looks binary" in warned[0]
    controls = bytes(b for b in range(1, 32) if b not in b"\t\n\r\x0b\x0c\x08\x1b") * 10 + b"x" * 4000
    with pytest.raises(DataError, match=r"240 of its first 4240 bytes are control characters"):
        read_document_text(controls, "ctl")  # 5.7% without a NUL byte
    assert read_document_text(controls[:150] + b"x" * 3000, "ctl", warn=pytest.fail)  # 4.8%: text


def test_legacy_encodings_and_terminal_text_are_text_with_a_warning(tmp_path):
    from memagent.data.io import read_document_text

    warned = []
    russian = "Привет, мир. " * 20
    text = read_document_text(russian.encode("cp1251"), "ru", warn=warned.append)  # not refused as binary
    assert text.count(", ") == 20 and text.count(". ") == 20 and set(text) == {"\ufffd", ",", ".", " "}
    assert warned == ["ru is not valid UTF-8 (invalid continuation byte at byte 0); undecodable bytes are replaced "
                      "by U+FFFD"]
    colored = b"\x1b[31merror\x1b[0m: disk full\x08\n"
    assert read_document_text(colored, "log", warn=pytest.fail) == colored.decode()
    warned.clear()
    assert read_document_text("\ufeffab".encode("utf-16-le")[:-1] + b"", "odd", warn=warned.append) == "a\ufffd"
    assert warned[0].startswith("odd is not valid UTF-16 (by its byte-order mark) (truncated data at byte 4)")
    warned.clear()
    assert read_document_text(b" \n", "blank", warn=warned.append) == " \n"
    assert warned == ["the document (blank) is empty or whitespace only: the memory learns nothing from it, the answer rests on the question alone"]
    with pytest.raises(DataError, match="is not a file"):
        read_document_text(tmp_path)


def test_a_stray_control_character_does_not_make_a_text_binary():
    from memagent.data.io import read_document_text

    assert read_document_text(b"hello\x04world\n", "t", warn=pytest.fail) == "hello\x04world\n"  # 1 of 12 bytes
    with pytest.raises(DataError, match="17 of its first 17 bytes"):
        read_document_text(b"\x01" * 17, "t")


def test_json_lines_from_stdin_and_from_a_pipe(tmp_path, monkeypatch):
    import io
    import os
    import sys

    rows = b'{"id": "a", "question": "q", "context": "c"}\n\n{"id": "b", "question": "q", "context": "d"}\n'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(rows)))
    assert [s.id for s in read_samples("-")] == ["a", "b"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"id": "a"}\n')))
    with pytest.raises(DataError, match="^stdin:1: "):
        read_samples("-")
    import subprocess

    fifo, src = tmp_path / "pipe", tmp_path / "rows.jsonl"
    src.write_bytes(rows)
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", 'cat "$0" > "$1"', str(src), str(fifo)])  # as a shell's <(cat rows.jsonl)
    try:
        assert [s.id for s in read_samples(fifo)] == ["a", "b"]
    finally:
        writer.wait(timeout=10)


def test_a_sample_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    from memagent.errors import DataError
    from memagent.types import Sample

    for bad, message in (([Sample("a", "q", "c", metadata={"s": {1}})], "not JSON serializable"),
                         ([{"id": "a"}], r"samples\[0\] is a dict, not a Sample")):
        with pytest.raises(DataError, match=message):
            write_samples(tmp_path / "x.jsonl", bad)
        assert list(tmp_path.iterdir()) == []  # neither the file nor x.jsonl.tmp
