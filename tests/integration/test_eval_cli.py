"""`memagent eval` and `memagent report` end to end with the scripted backend (no model)."""

import json

import typer
from typer.testing import CliRunner

from memagent.eval.cli import eval_command, report_command


def _app():
    app = typer.Typer()
    app.command("eval")(eval_command)
    app.command("report")(report_command)
    return app


def test_eval_flags_then_resume_then_report(tmp_path):
    out = tmp_path / "run"
    args = ["eval", "--tasks", "niah_single_1,vt", "--lengths", "2K", "-n", "3", "--backend", "scripted",
            "--chunk-tokens", "1000", "--memory-tokens", "128", "--final-tokens", "64", "--max-new-tokens", "64",
            "--max-input-tokens", "1500", "-o", str(out)]
    r = CliRunner().invoke(_app(), args)
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3 and {r["method"] for r in rows} == {"memagent", "direct"}
    assert {r["metric"] for r in rows} == {"string_match_all"}
    assert (out / "data" / "vt_2048.jsonl").is_file() and (out / "summary.md").is_file() and (out / "accuracy.png").is_file()
    r = CliRunner().invoke(_app(), args)  # resume: nothing left to do
    assert r.exit_code == 0 and "0 to run" in r.output and "3 to run" not in r.output
    assert len((out / "results.jsonl").read_text().splitlines()) == 12
    r = CliRunner().invoke(_app(), ["report", str(out), "--out", str(tmp_path / "rep"), "--no-plot"])
    assert r.exit_code == 0, r.output
    assert "niah_single_1" in (tmp_path / "rep" / "summary.md").read_text()


def test_eval_with_fewer_methods_keeps_the_others_in_manifest_and_report(tmp_path):
    out = tmp_path / "run"
    base = ["eval", "--tasks", "niah_single_1", "--backend", "scripted", "--chunk-tokens", "1000", "--memory-tokens", "128",
            "--final-tokens", "64", "--max-new-tokens", "64", "--max-input-tokens", "1500", "-o", str(out)]
    r = CliRunner().invoke(_app(), base + ["--lengths", "1K,2K", "--methods", "memagent,direct", "-n", "3"])
    assert r.exit_code == 0, r.output
    first = json.loads((out / "manifest.json").read_text())
    r = CliRunner().invoke(_app(), base + ["--lengths", "1K", "--methods", "memagent", "-n", "5"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3 + 2 and sum(x["method"] == "direct" for x in rows) == 6
    m = json.loads((out / "manifest.json").read_text())
    assert m["method_hashes"] == first["method_hashes"] and set(m["method_hashes"]) == {"memagent", "direct"}
    assert m["prompt_hashes"] == first["prompt_hashes"] and set(m["prompt_hashes"]) == {"memagent", "direct"}
    assert [x["name"] for x in m["config"]["methods"]] == ["memagent", "direct"]
    summary = (out / "summary.md").read_text()
    (head,) = [x for x in summary.splitlines() if x.startswith("| length (tokens) |")]
    assert sorted(head.strip("| ").split(" | ")[1:]) == ["direct", "memagent"]
    assert f"prompt hashes {first['prompt_hashes']}" in summary


def test_eval_config_file_and_errors(tmp_path):
    cfg = tmp_path / "grid.yaml"
    cfg.write_text("methods: [{name: m, chunk_tokens: 500}]\ntasks: [{name: vt, lengths: [2048], samples: 2}]\n"
                   "backend: {name: scripted}\n")
    r = CliRunner().invoke(_app(), ["eval", "--config", str(cfg), "-o", str(tmp_path / "o"), "--no-report"])
    assert r.exit_code == 0, r.output
    assert len((tmp_path / "o" / "results.jsonl").read_text().splitlines()) == 2
    cfg.write_text("methods: [{name: m, chunk_tokns: 500}]\ntasks: []\n")
    r = CliRunner().invoke(_app(), ["eval", "--config", str(cfg)])
    assert r.exit_code == 2 and "did you mean 'chunk_tokens'" in r.output
    r = CliRunner().invoke(_app(), ["eval", "--methods", "magic", "--backend", "scripted"])
    assert r.exit_code == 2 and "unknown method 'magic'" in r.output
    r = CliRunner().invoke(_app(), ["eval", "--backend", "openai", "--model", "x"])
    assert r.exit_code == 2 and "--base-url" in r.output
    r = CliRunner().invoke(_app(), ["report", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "not found" in r.output
    r = CliRunner().invoke(_app(), ["eval", "--tasks", "hotpotqa,vt", "--lengths", "50", "--backend", "scripted"])
    assert r.exit_code == 2 and "hotpotqa counts documents and the other tasks count tokens" in r.output
    r = CliRunner().invoke(_app(), ["eval", "--tasks", "hotpotqa", "--lengths", "8K", "--backend", "scripted"])
    assert r.exit_code == 2 and "--lengths: '8K': a number of documents takes no K/M suffix" in r.output
    # a flag that only the method kind left out of --methods would use is warned about (not refused: the same
    # command line with fewer --methods continues a grid in pieces)
    for k, (flags, message) in enumerate([
            (["--methods", "direct", "--chunk-tokens", "100", "--templates", "chunk_first"],
             "warning: --chunk-tokens, --templates apply to --methods memagent only, which this run does not include, "
             "so they are not used"),
            (["--methods", "memagent", "--max-new-tokens", "32"],
             "warning: --max-new-tokens applies to --methods direct only, which this run does not include, so it is not used")]):
        r = CliRunner().invoke(_app(), ["eval", "--tasks", "vt", "--lengths", "4K", "-n", "1", "--backend", "scripted",
                                        "--tokenizer", "bytes", "--no-report", *flags, "-o", str(tmp_path / f"kinds{k}")])
        assert r.exit_code == 0 and message in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(_app(), ["eval", "--tasks", "vt", "--lengths", "4K", "-n", "1", "--backend", "scripted",
                                    "--tokenizer", "bytes", "--no-report", "--chunk-tokens", "300", "-o", str(tmp_path / "kinds2")])
    assert r.exit_code == 0 and "warning" not in r.output, r.output  # both methods: every flag is used
    (tmp_path / "torn").mkdir()
    for text, message in [('{"method": "m", "task": "vt"}\n', "results.jsonl:1: malformed result row (no 'length' field)"),
                          ('[1, 2]\n', "results.jsonl:1: malformed result row (expected a JSON object, got list)")]:
        (tmp_path / "torn" / "results.jsonl").write_text(text + "{}\n")
        r = CliRunner().invoke(_app(), ["report", str(tmp_path / "torn")])
        assert r.exit_code == 2 and message in r.output, r.output


def test_eval_only_runs_named_cells(tmp_path):
    out = tmp_path / "run"
    args = ["eval", "--tasks", "niah_single_1,vt", "--lengths", "1K,2K", "-n", "2", "--backend", "scripted",
            "--chunk-tokens", "1000", "--memory-tokens", "128", "--final-tokens", "64", "--max-new-tokens", "64",
            "--max-input-tokens", "1500", "-o", str(out), "--no-report"]
    r = CliRunner().invoke(_app(), args + ["--only", "vt:2K, niah_single_1"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({(x["task"], x["length"]) for x in rows}) == [("niah_single_1", 1024), ("niah_single_1", 2048), ("vt", 2048)]
    assert len(rows) == 3 * 2 * 2
    r = CliRunner().invoke(_app(), args + ["--only", "vt:4K"])
    assert r.exit_code == 2 and "has no length 4096" in r.output
    other = tmp_path / "direct_first"
    r = CliRunner().invoke(_app(), [str(other) if a == str(out) else a for a in args] + ["--only", "vt:2K", "--only-methods", " direct"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (other / "results.jsonl").read_text().splitlines()]
    assert {(x["method"], x["task"], x["length"]) for x in rows} == {("direct", "vt", 2048)} and len(rows) == 2
    # a repeated flag adds to the earlier ones instead of replacing them
    repeated = tmp_path / "repeated"
    r = CliRunner().invoke(_app(), [str(repeated) if a == str(out) else a for a in args]
                           + ["--only", "vt:2K", "--only", "niah_single_1:1K", "--only-methods", "direct", "--only-methods", "memagent"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (repeated / "results.jsonl").read_text().splitlines()]
    assert sorted({(x["method"], x["task"], x["length"]) for x in rows}) == [
        ("direct", "niah_single_1", 1024), ("direct", "vt", 2048), ("memagent", "niah_single_1", 1024), ("memagent", "vt", 2048)]
    assert len(rows) == 4 * 2


def test_eval_exits_1_when_a_sample_failed(tmp_path):
    from memagent.data.io import write_samples
    from memagent.types import Sample

    data = tmp_path / "q.jsonl"
    write_samples(data, [Sample("ok", "Q?", "doc", ("a",)), Sample("long", "Q" * 9000, "doc", ("a",))])
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(f"output: {tmp_path / 'run'}\nbackend: {{name: scripted, context_tokens: 4096}}\n"
                   "methods: [{name: m, chunk_tokens: 500, memory_tokens: 64, final_tokens: 64}]\n"
                   f"tasks: [{{name: t, lengths: ['1'], samples: 2, files: {{1: {data}}}}}]\n")
    r = CliRunner().invoke(_app(), ["eval", "--config", str(cfg), "--no-report", "-n", "5", "--seed", "3"])
    assert r.exit_code == 1 and "1 of 2 samples failed" in r.output
    # the failure is a question too long for the budget: the advice says a retry alone refuses it again
    assert "1 of them were not run, their question being too long for the method's budget" in " ".join(r.output.split())
    assert "warning: --samples, --seed ignored: --config" in r.output
    assert len((tmp_path / "run" / "results.jsonl").read_text().splitlines()) == 2


def test_only_without_cells_and_report_into_a_file_are_refused(tmp_path):
    r = CliRunner().invoke(_app(), ["eval", "--tasks", "vt", "--lengths", "4K", "-n", "1", "--backend", "scripted",
                                    "-o", str(tmp_path / "run"), "--only", ","])
    assert r.exit_code == 2 and "name at least one cell" in r.output
    (tmp_path / "file").write_text("x")
    r = CliRunner().invoke(_app(), ["eval", "--tasks", "niah_single_1", "--lengths", "2K", "-n", "1", "--backend",
                                    "scripted", "--chunk-tokens", "1000", "--memory-tokens", "128", "--final-tokens",
                                    "64", "--max-new-tokens", "64", "--max-input-tokens", "1500", "-o",
                                    str(tmp_path / "run"), "--no-report"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(_app(), ["report", str(tmp_path / "run"), "--out", str(tmp_path / "file")])
    assert r.exit_code == 2 and "is a file" in r.output
    r = CliRunner().invoke(_app(), ["report", str(tmp_path / "run"), "--out", str(tmp_path / "file" / "sub")])
    assert r.exit_code == 2 and "which is a file: give a folder with --out" in " ".join(r.output.split()), r.output


def test_default_lengths_follow_the_task_and_bad_outputs_are_refused(tmp_path, data_root):
    from memagent.data.cli import app as data_app

    base = ["eval", "--tasks", "vt", "-n", "1", "--backend", "scripted", "--methods", "direct", "--no-report"]
    r = CliRunner().invoke(_app(), base + ["-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "[direct | vt | 8192] 0 done, 1 to run" in r.output  # RULER's default: 8K tokens, not 50
    (tmp_path / "afile").write_text("x")
    r = CliRunner().invoke(_app(), base + ["-o", str(tmp_path / "afile")])
    assert r.exit_code == 2 and "run folder" in r.output and "is a file: give a folder with --output" in r.output
    r = CliRunner().invoke(_app(), base + ["-o", str(tmp_path / "neg"), "--n-ctx", "-5"])
    # the option's declared bound (BackendOptions.n_ctx, shared with `memagent run`) refuses it before any backend
    assert r.exit_code == 2 and "--n-ctx" in r.output and "greater than or equal to 1" in r.output, r.output
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    r = CliRunner().invoke(_app(), base + ["-o", str(tmp_path / "dangling")])
    assert r.exit_code == 2 and "is a broken link: give a folder with --output" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(data_app, ["ruler", "--task", "vt", "--tokenizer", "bytes", "-o", str(tmp_path / "dangling" / "x")])
    assert r.exit_code == 2 and "a broken link: give a folder" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(_app(), base + ["-o", str(tmp_path / "afile" / "sub")])
    assert r.exit_code == 2 and f"is under {str(tmp_path / 'afile')!r}, which is a file: give a folder with --output" \
        in " ".join(r.output.split()), r.output
    for args in (["ruler", "--task", "vt", "--tokenizer", "bytes"], ["hotpotqa", "--docs", "20", "--tokenizer", "bytes"]):
        r = CliRunner().invoke(data_app, args + ["-o", str(tmp_path / "afile")])
        assert r.exit_code == 2 and "is a file: give a folder" in r.output, r.output
        r = CliRunner().invoke(data_app, args + ["-o", str(tmp_path / "afile" / "sub")])
        assert r.exit_code == 2 and "which is a file: give a folder" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(data_app, ["ruler", "--task", "niah_single_2", "--lengths", "100", "--tokenizer", "bytes",
                                      "-o", str(tmp_path / "d"), "--data-root", str(data_root)])
    assert r.exit_code == 2 and "leaves -28 tokens for the prompt" in r.output, r.output
    assert not (tmp_path / "d").exists()  # the folder the refused build made is removed again (it was empty)
    r = CliRunner().invoke(data_app, ["ruler", "--task", "niah_single_2", "--lengths", "100", "--tokenizer", "bytes",
                                      "-o", str(tmp_path / "nest" / "a" / "b"), "--data-root", str(data_root)])
    assert r.exit_code == 2 and not (tmp_path / "nest").exists()  # and the folders it made on the way


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "memagent", "eval", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--only-methods" in r.stdout


def test_report_refuses_another_runs_folder_and_warns_about_another_tokenizer(tmp_path):
    row = {"method": "m", "task": "vt", "length": 2048, "sample_id": "a", "status": "ok", "score": 1.0,
           "scores": {"string_match_all": 1.0}, "metric": "string_match_all"}
    for name, tok in (("a", "bytes"), ("b", "SmolLM2-135M-Instruct.Q4_1.gguf")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text(json.dumps(row) + "\n")
        (tmp_path / name / "manifest.json").write_text(json.dumps({"name": name, "tokenizer": tok}))
    r = CliRunner().invoke(_app(), ["report", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--no-plot"])
    assert r.exit_code == 2 and f"error: --out {str(tmp_path / 'b')!r} is another eval run's folder (it holds " \
        "results.jsonl), not one of the runs reported" in " ".join(r.output.split()), r.output
    assert not (tmp_path / "b" / "summary.md").exists()
    r = CliRunner().invoke(_app(), ["report", str(tmp_path / "a"), "--no-plot", "--tokenizer", "bytes"])
    assert r.exit_code == 0 and "warning" not in r.output, r.output  # the run's own tokenizer
    r = CliRunner().invoke(_app(), ["report", str(tmp_path / "b"), "--no-plot", "--tokenizer", "bytes"])
    assert r.exit_code == 0, r.output  # used, not refused: a warning naming both
    assert (f"warning: --tokenizer bytes (bytes) is not the tokenizer {tmp_path / 'b'} recorded "
            "(SmolLM2-135M-Instruct.Q4_1.gguf); its evidence numbers (read %, outcomes) are computed with "
            "--tokenizer's and may differ from the run's own") in " ".join(r.output.split())
    assert (tmp_path / "b" / "summary.md").is_file()


def test_eval_lora_policy_flags_bring_its_trained_budgets(tmp_path, monkeypatch):
    """`eval --lora ruler-niah` (flags, no --config) runs the memory agent with the budgets the policy was trained
    with, as `run` and `demo` do (it loaded the policy's base model but kept 5000/1024/1024: every memory hit the
    1024-token cap); a budget given on the command line still wins."""
    import memagent.eval.runner as runner_module
    from memagent.errors import ConfigError

    seen = []

    class Stop:  # records the grid the flags built; no model is loaded
        def __init__(self, cfg, **kwargs):
            seen.append(cfg)
            raise ConfigError("stopped before the run")

    monkeypatch.setattr(runner_module, "EvalRunner", Stop)
    base = ["eval", "--tasks", "niah_single_2", "--lengths", "2K", "-n", "1", "--methods", "memagent",
            "--lora", "ruler-niah", "-o", str(tmp_path / "run")]
    r = CliRunner().invoke(_app(), base)
    assert "stopped before the run" in r.output, r.output
    agent = seen[-1].methods[0].agent
    assert (agent.chunk_tokens, agent.memory_tokens, agent.final_tokens) == (512, 64, 48)
    assert "policy ruler-niah: with the settings it was trained with" in r.output
    r = CliRunner().invoke(_app(), base + ["--chunk-tokens", "1024"])
    agent = seen[-1].methods[0].agent
    assert (agent.chunk_tokens, agent.memory_tokens) == (1024, 64), r.output
