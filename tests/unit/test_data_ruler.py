"""RULER task builders: exact token budgets, answers present, determinism, few full tokenizations, files."""

import json
import re
from collections import Counter

import pytest
from typer.testing import CliRunner

from memagent.data.ruler import ALL_TASKS, RULER_METRIC, build_ruler_sample
from memagent.data.ruler.build import build_ruler
from memagent.data.ruler.common import fit_length, insert_at_fractions, ruler_record, split_sentences
from memagent.errors import ConfigError, DataError, UnknownNameError
from memagent.tokenization import ByteTokenizer


def test_split_sentences():
    text = 'He said "Go." Then he left!  Was it 5 p.m.? 3 cats came. e.g. not here. (Yes) ok'
    assert split_sentences(text) == ['He said "Go."', "Then he left!", "Was it 5 p.m.?", "3 cats came. e.g. not here.", "(Yes) ok"]
    assert " ".join(split_sentences("A b.\n\nC d. ")) == "A b. C d."
    assert split_sentences("  ") == []


def test_insert_at_fractions():
    assert insert_at_fractions(["a", "b", "c", "d"], ["X", "Y"], [0.5, 0.0]) == ["X", "a", "b", "Y", "c", "d"]
    assert insert_at_fractions([], ["X"], [0.7]) == ["X"]


def test_fit_length_exact_with_bytes():
    tok = ByteTokenizer()
    calls = []

    def build(n):
        calls.append(n)
        text = "Q\n" + "\n".join(f"line {i}" for i in range(n))
        return n, text

    cost = lambda n: 7 * n  # noqa: E731  (estimate: "line i\n" is 7 bytes for i < 10, 8 after)
    f = fit_length(build, cost, 10_000, 500, tok, tolerance_tokens=0)
    n_calls = len(calls)
    # exact answer: the largest n with len(text) <= 500
    best = max(n for n in range(200) if len(build(n)[1]) <= 500)
    assert f.n == best and f.tokens == len(build(best)[1]) <= 500
    assert n_calls <= 6
    with pytest.raises(DataError, match=r"only 1 haystack units is 8 tokens, over the budget of 1 tokens .* use a longer length"):
        fit_length(build, cost, 10, 1, tok, min_units=1)
    # 10 units make a 71-byte prompt: a 5000-token length cannot be filled, and is refused rather than cut short
    with pytest.raises(DataError, match=r"the haystack holds 10 units, a prompt of 71 tokens, short of the 5000-token "
                                        r"budget of this length: use a length of at most about 71 tokens"):
        fit_length(build, cost, 10, 5000, tok)
    assert fit_length(build, cost, 10, 80, tok).n == 10  # within the tolerance (20 tokens): accepted


class CountingTokenizer:
    """Counts how many characters it was asked to tokenize."""

    def __init__(self, inner):
        self.inner, self.name, self.chars = inner, inner.name, 0

    def encode(self, text):
        self.chars += len(text)
        return self.inner.encode(text)

    def encode_with_offsets(self, text):
        self.chars += len(text)
        return self.inner.encode_with_offsets(text)

    def decode(self, ids):
        return self.inner.decode(ids)


@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_task_fits_its_budget(task, gguf_tokenizer, data_root):
    length = 4096
    s = build_ruler_sample(task, length, 3, gguf_tokenizer, seed=42, data_root=str(data_root))
    rec = ruler_record(s)
    n = len(gguf_tokenizer.encode(rec["input"]))
    budget = length - s.metadata["tokens_to_generate"]
    assert s.metadata["length_tokens"] == n <= budget
    slack = 450 if task.startswith("qa") else 60  # qa stops when the next paragraph would overflow
    assert n >= budget - slack
    assert rec["length"] == n + s.metadata["tokens_to_generate"] and rec["outputs"] == list(s.answers)
    assert rec["input"].startswith(s.metadata["ruler_prefix"]) and s.context in rec["input"]
    assert s.id == f"{task}-4096-3" and s.metadata["tokenizer"] == gguf_tokenizer.name
    assert all(a for a in s.answers)
    if task not in ("cwe", "fwe") and not task.startswith("qa"):
        for a in s.answers:  # every needle answer is in the haystack
            assert a in s.context
    assert RULER_METRIC[task] == ("string_match_part" if task.startswith("qa") else "string_match_all")


def test_determinism_and_per_index_randomness(gguf_tokenizer, data_root):
    a = build_ruler_sample("niah_single_1", 2048, 0, gguf_tokenizer, seed=1)
    b = build_ruler_sample("niah_single_1", 2048, 0, gguf_tokenizer, seed=1)
    assert a.to_dict() == b.to_dict()
    others = [build_ruler_sample("niah_single_1", 2048, i, gguf_tokenizer, seed=1) for i in range(1, 6)]
    positions = {o.context.index(o.answers[0]) for o in others + [a]}
    assert len(positions) == 6  # the needle moves from sample to sample
    assert build_ruler_sample("niah_single_1", 2048, 0, gguf_tokenizer, seed=2).answers != a.answers


def test_task_contents(gguf_tokenizer):
    vt = build_ruler_sample("vt", 2048, 0, gguf_tokenizer)
    names = vt.answers
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", x) for x in names)
    value = re.search(r"VAR " + names[0] + r" = (\d{5})", vt.context).group(1)
    for prev, nxt in zip(names, names[1:]):
        assert f"VAR {nxt} = VAR {prev}" in vt.context
    assert f"value {value}" in vt.question

    cwe = build_ruler_sample("cwe", 4096, 0, gguf_tokenizer)
    items = Counter(re.findall(r"^\d+\. (\S+)$", cwe.context, re.M))
    assert {w: items[w] for w in cwe.answers} == {w: 30 for w in cwe.answers}
    assert max(c for w, c in items.items() if w not in cwe.answers) == 3

    fwe = build_ruler_sample("fwe", 4096, 0, gguf_tokenizer)
    counts = Counter(fwe.context.split(" "))
    top = [w for w, _ in counts.most_common(4)]
    assert top[0] == "..." and tuple(top[1:]) == fwe.answers


def test_incremental_fitting_tokenizes_little(gguf_tokenizer):
    tok = CountingTokenizer(gguf_tokenizer)
    s = build_ruler_sample("niah_multikey_2", 16384, 0, tok)
    prompt_chars = len(ruler_record(s)["input"])
    # unit costs (one pass over the haystack) + a few exact counts; a per-step search would be ~10x more
    assert tok.chars <= 6 * prompt_chars


def test_unknown_task_and_qa_index():
    with pytest.raises(UnknownNameError, match="niah_single_1"):
        build_ruler_sample("niah_singel_1", 4096, 0, ByteTokenizer())


def test_a_question_too_long_for_the_length_is_named(data_root, tmp_path):
    from memagent.errors import DataError

    with pytest.raises(DataError, match=r"^question '[0-9a-f]+': the question's own documents alone take"):
        build_ruler_sample("qa_1", 300, 3, ByteTokenizer(), data_root=data_root)
    # built as a file, the sample is named and every sample is tried: the advice fits them all
    with pytest.raises(DataError, match=r"^qa_1: 4 of 4 do not fit at 300 tokens; the one that needs most, sample \d: "
                                        r"question '[0-9a-f]+': .* at least \d+ tokens longer$"):
        build_ruler(tmp_path / "never", ["qa_1"], [300], ByteTokenizer(), num_samples=4, data_root=data_root)


def test_build_files_and_cli(tmp_path, gguf_tokenizer, data_root):
    files = build_ruler(tmp_path, ["niah_single_1", "vt"], [2048], gguf_tokenizer, num_samples=2, seed=5)
    assert [f.name for f in files] == ["niah_single_1_2048.jsonl", "vt_2048.jsonl"]
    rows = [json.loads(x) for x in (tmp_path / "vt_2048.ruler.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and set(rows[0]) == {"index", "input", "outputs", "length", "answer_prefix"}
    man = json.loads((tmp_path / "vt_2048.manifest.json").read_text())
    assert man["num_samples"] == 2 and man["seed"] == 5 and man["input_tokens"]["max"] <= 2048 - 30

    from memagent.data.cli import app, parse_ints

    assert parse_ints("8K,16384", "--lengths") == [8192, 16384]
    assert parse_ints("4K,4096, 8K", "--lengths") == [4096, 8192] and parse_ints(" ", "--lengths") == []
    out = tmp_path / "cli"
    r = CliRunner().invoke(app, ["ruler", "--task", "niah_single_1,niah_single_1", "--lengths", "2K,2048", "-n", "1",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [str(out / "niah_single_1_2048.jsonl")]  # built once
    assert (out / "niah_single_1_2048.jsonl").is_file()
    r = CliRunner().invoke(app, ["ruler", "--task", "nope", "-o", str(out)])
    assert r.exit_code == 2 and "unknown RULER task" in r.output
    r = CliRunner().invoke(
        app, ["hotpotqa", "--docs", "12", "-n", "2", "-o", str(out), "--data-root", str(data_root), "--tokenizer", "bytes"]
    )
    assert r.exit_code == 0, r.output
    assert len((out / "hotpotqa_12docs.jsonl").read_text().splitlines()) == 2
    bad = [
        (["hotpotqa", "--docs", "12", "-n", "1", "--split", "test"], "--split must be dev or train"),
        (["hotpotqa", "--docs", "12", "-n", "1", "--start", "-5"], "need --start >= 0"),
        (["hotpotqa", "--docs", "12", "-n", "0"], "--samples >= 1"),
        (["ruler", "--task", "niah_single_2", "-l", "2K", "-n", "1", "--haystack", "gutenbrg"], "essay .* or gutenberg"),
        (["ruler", "--task", "vt", "-l", "2K", "-n", "0"], "--samples must be >= 1"),
        (["ruler", "--task", " ,", "-l", "2K", "-n", "1"], "--task: name at least one task"),
        (["ruler", "--task", "vt", "-l", "", "-n", "1"], "--lengths: give at least one target length"),
        (["hotpotqa", "--docs", "50,8k", "-n", "1"], "--docs: '8k': a number of documents takes no K/M suffix"),
    ]
    for args, message in bad:
        r = CliRunner().invoke(app, args + ["-o", str(tmp_path / "bad"), "--tokenizer", "bytes"])
        assert r.exit_code == 2 and re.search(message, r.output), (args, r.output)
    assert not (tmp_path / "bad").exists()
    r = CliRunner().invoke(app, ["ruler", "--task", "vt", "-l", "40", "-n", "1", "-o", str(tmp_path / "short"), "--tokenizer", "bytes"])
    assert r.exit_code == 2 and re.search("vt: sample 0 at 40 tokens: the prompt with only 0 haystack units is 1156 tokens, over "
                                          "the budget of 10 tokens .* use a longer length", r.output), r.output
    # a length that cannot be built leaves no partial output, even after other cells were built
    r = CliRunner().invoke(app, ["ruler", "--task", "niah_single_1,vt", "-l", "2K,40", "-n", "1", "-o",
                                 str(tmp_path / "mixed"), "--tokenizer", "bytes"])
    assert r.exit_code == 2 and "niah_single_1: sample 0 at 40 tokens" in r.output, r.output  # after niah_single_1 at 2K
    assert not (tmp_path / "mixed").exists()  # nothing written, so the folder it made is gone too


def test_same_seed_same_bytes(tmp_path, gguf_tokenizer):
    for d in ("a", "b"):
        build_ruler(tmp_path / d, ["niah_multikey_2", "fwe"], [2048], gguf_tokenizer, num_samples=2, seed=3)
    for name in ("niah_multikey_2_2048.jsonl", "niah_multikey_2_2048.ruler.jsonl", "fwe_2048.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_every_command_reads_the_smollm2_tokenizer_spec(gguf_tokenizer):
    from memagent.tokenization import load_tokenizer

    tok = load_tokenizer("smollm2")
    assert tok.encode("Were Scott Derrickson and Ed Wood of the same nationality?") == gguf_tokenizer.encode(
        "Were Scott Derrickson and Ed Wood of the same nationality?")
    with pytest.raises(ConfigError, match="give 'bytes', 'smollm2', a .gguf file"):
        load_tokenizer("no-such-tokenizer")


def test_a_killed_builds_staging_folder_is_removed_by_the_next_build(tmp_path):
    import os
    import subprocess
    import sys

    from memagent.data.ruler.build import remove_stale_stages

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its id now names no process (a build killed with SIGKILL leaves such a folder)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (f".building-{dead.pid}", f".building-{live.pid}", ".building-notapid"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "vt_2048.jsonl").write_text("partial\n")
        (tmp_path / f".building-{os.getpid() + 10**7}").write_text("a file, not a stage\n")
        build_ruler(tmp_path, ["vt"], [2048], ByteTokenizer(), num_samples=1, seed=5)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([f".building-{live.pid}", ".building-notapid", f".building-{os.getpid() + 10**7}",
                               "vt_2048.jsonl", "vt_2048.manifest.json", "vt_2048.ruler.jsonl"])
        assert remove_stale_stages(tmp_path) == []  # a running build's folder is kept
    finally:
        live.kill()
        live.wait()
    assert remove_stale_stages(tmp_path) == [tmp_path / f".building-{live.pid}"]


def test_qa_prefix_manifest_haystack_and_a_length_that_is_too_short(tmp_path, data_root):
    """qa's answer prefix is RULER's " Answer:"; a manifest names the haystack its samples used (noise for
    niah_single_1 and vt, whatever --haystack says); a qa length too short names how much longer it must be, and
    that much more builds."""
    build_ruler(tmp_path / "h", ["niah_single_1", "niah_single_2"], [2048], ByteTokenizer(), num_samples=1,
                haystack="gutenberg", data_root=data_root)
    kinds = {t: json.loads((tmp_path / "h" / f"{t}_2048.manifest.json").read_text())["haystack"]
             for t in ("niah_single_1", "niah_single_2")}
    assert kinds == {"niah_single_1": "noise", "niah_single_2": "gutenberg"}
    with pytest.raises(DataError, match=r"give a target length at least (\d+) tokens longer") as e:
        build_ruler_sample("qa_2", 2048, 0, ByteTokenizer(), data_root=data_root)
    more = int(re.search(r"at least (\d+) tokens longer", str(e.value)).group(1))
    s = build_ruler_sample("qa_2", 2048 + more + 64, 0, ByteTokenizer(), data_root=data_root)
    assert s.metadata["answer_prefix"] == " Answer:" and s.answers
