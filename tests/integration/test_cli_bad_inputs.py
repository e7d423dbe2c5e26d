"""Bad inputs at the command line (issue 17): each gives exit status 2 and a message naming the input and the
fix, before any model call and before any output file is touched. The catalogue is docs/reliability.md."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from memagent.cli import app

runner = CliRunner()

GOOD = '{"id": "a", "question": "q?", "context": "fine doc"}\n'
LONE_SURROGATE = '{"id": "b", "question": "q?", "context": "bad \\ud800 doc"}\n'


def _run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def test_run_input_with_a_lone_surrogate_exits_2_naming_file_and_line(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(GOOD + LONE_SURROGATE)
    r = _run("run", "-b", "scripted", "-i", inp, "-o", out)
    assert r.exit_code == 2, r.output
    assert f"{inp}:2: field 'context' holds a lone surrogate U+D800 at character 4" in r.output
    assert "Traceback" not in r.output and not out.exists()
    out.write_text('{"id": "a", "status": "ok"}\n')  # --resume hits it at read time too, and keeps the file
    r = _run("run", "-b", "scripted", "-i", inp, "-o", out, "--resume")
    assert r.exit_code == 2 and f"{inp}:2:" in r.output
    assert out.read_text() == '{"id": "a", "status": "ok"}\n'


def test_eval_with_a_lone_surrogate_in_a_task_file_exits_2_before_any_cell(tmp_path):
    from memagent.eval.cli import eval_command

    data = tmp_path / "mine.jsonl"
    data.write_text(GOOD.replace('"a"', '"a", "answers": ["x"]') + LONE_SURROGATE.replace('"b"', '"b", "answers": ["x"]'))
    cfg = tmp_path / "grid.yaml"
    cfg.write_text("methods: [{name: m, chunk_tokens: 500}]\n"
                   f"tasks: [{{name: mine, lengths: [1K], metrics: [sub_em], files: {{1K: {data}}}}}]\n"
                   "backend: {name: scripted}\n")
    ev = typer.Typer()
    ev.command("eval")(eval_command)
    ev.command("other")(lambda: None)
    r = runner.invoke(ev, ["eval", "--config", str(cfg), "-o", str(tmp_path / "o"), "--no-report"])
    assert r.exit_code == 2, r.output
    assert f"{data}:2: field 'context' holds a lone surrogate" in " ".join(r.output.split())
    results = tmp_path / "o" / "results.jsonl"
    assert not results.exists() or results.read_text() == ""


def test_the_python_api_refuses_a_lone_surrogate_before_any_call():
    import pytest

    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.backends.scripted import ScriptedBackend
    from memagent.errors import ConfigError
    from memagent.types import Sample

    backend = ScriptedBackend()
    agent = MemoryAgent(backend, AgentConfig(chunk_tokens=50, memory_tokens=16, final_tokens=16))
    samples = [Sample("a", "q?", "fine"), Sample("b", "q?", "bad \ud800 doc")]
    with pytest.raises(ConfigError, match=r"sample b: the document holds a lone surrogate U\+D800 at character 4"):
        agent.run(samples)
    assert backend.calls == []
    r = _run("run", "-b", "scripted", "-q", "bad \udcff?", "-d", "-", input="doc")  # argv's undecodable bytes
    assert r.exit_code == 2 and "the question holds a lone surrogate U+DCFF at character 4" in r.output


def test_vllm_with_a_model_path_that_does_not_exist_exits_2_naming_it():
    r = _run("run", "-b", "vllm", "--model", "/nonexistent", "-q", "Q", "-d", "-", input="doc")
    assert r.exit_code == 2 and "model '/nonexistent' does not exist" in r.output, r.output


def test_run_reads_a_utf16_document_by_its_byte_order_mark(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_bytes("Grüße aus Köln\n".encode("utf-16"))  # the scripted model answers with the first line
    r = _run("run", "-q", "Q", "-d", doc, "-b", "scripted")
    assert r.exit_code == 0 and r.stdout.strip().splitlines()[-1] == "Grüße aus Köln", r.output
    assert "warning" not in r.output


def test_run_refuses_a_binary_document_unless_allowed(tmp_path):
    doc = tmp_path / "a.bin"
    doc.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00 header bytes\n")
    r = _run("run", "-q", "Q", "-d", doc, "-b", "scripted")
    assert r.exit_code == 2 and "looks like a binary file, not text (it holds NUL bytes (the first at byte 7)" in \
        " ".join(r.output.split()) and "--allow-binary" in r.output
    r = _run("run", "-q", "Q", "-d", doc, "-b", "scripted", "--allow-binary")
    assert r.exit_code == 0 and "warning:" in r.output and "looks binary" in r.output
