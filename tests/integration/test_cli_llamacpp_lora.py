"""`memagent run|demo|eval` on the batched llama.cpp backend and with a LoRA adapter (SmolLM2-135M)."""

import hashlib
import json

import pytest
from typer.testing import CliRunner

from memagent.cli import app

pytestmark = pytest.mark.slow

DOC = ("The harbour of Vellmar is guarded by a lighthouse. " * 6 + "The secret code is 4417. " +
       "Boats arrive at dawn and leave at dusk. " * 6)


def _run(tmp_path, name, *extra):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    trace = tmp_path / f"{name}.jsonl"
    r = CliRunner().invoke(app, ["run", "-q", "What is the secret code?", "-d", str(doc), "--chunk-tokens", "100",
                                 "--memory-tokens", "32", "--final-tokens", "16", "--n-ctx", "1024",
                                 "--temperature", "0", "--threads", "1", "--trace", str(trace), *extra])
    turns = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    return r, [t["output"] for t in turns]


def test_run_on_the_batched_backend_and_with_an_adapter(tmp_path, smollm2_lora):
    r, base = _run(tmp_path, "base")
    assert r.exit_code == 0, r.output
    r, batched = _run(tmp_path, "batched", "--backend", "llamacpp-batch")
    assert r.exit_code == 0, r.output
    assert batched == base and len(base) >= 3  # greedy: the same memories and answer, turn for turn
    r, adapted = _run(tmp_path, "lora", "--lora", smollm2_lora)
    assert r.exit_code == 0, r.output
    assert adapted != base
    r, adapted_batched = _run(tmp_path, "lora_batched", "--lora", smollm2_lora, "-b", "llamacpp-batch")
    assert r.exit_code == 0, r.output
    assert adapted_batched == adapted


def test_bad_adapters_are_refused_naming_the_file(tmp_path, gguf_path):
    missing = tmp_path / "nope.gguf"
    r, _ = _run(tmp_path, "missing", "--lora", str(missing))
    assert r.exit_code != 0 and "LoRA adapter file not found" in r.output and "nope.gguf" in r.output, r.output
    r, _ = _run(tmp_path, "model", "--lora", gguf_path, "-b", "llamacpp-batch")
    assert r.exit_code != 0 and "cannot load the LoRA adapter" in r.output, r.output
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in r.output
    r, _ = _run(tmp_path, "hf", "--lora", gguf_path, "-b", "hf", "--model", gguf_path)
    assert r.exit_code != 0 and "--lora is not used by --backend hf" in r.output, r.output


def test_eval_method_with_an_adapter_runs_on_its_own_backend(tmp_path, smollm2_lora):
    from memagent.data.io import write_samples
    from memagent.eval.grid import EvalConfig
    from memagent.eval.runner import EvalRunner
    from memagent.runfiles import read_results
    from memagent.types import Sample

    data = tmp_path / "d.jsonl"
    write_samples(data, [Sample(f"s{k}", "What is the secret code?", DOC, ("4417",)) for k in range(2)])
    method = {"kind": "memory_agent", "chunk_tokens": 100, "memory_tokens": 32, "final_tokens": 16}
    cfg = EvalConfig.from_dict({
        "output": str(tmp_path / "run"), "temperature": 0.0,
        "backend": {"name": "llamacpp-batch", "n_ctx": 1024, "n_threads": 1},
        "methods": [{"name": "base", **method}, {"name": "rl", **method, "backend": {"lora_path": smollm2_lora}}],
        "tasks": [{"name": "mine", "lengths": [1], "samples": 2, "files": {1: str(data)}, "metrics": ["sub_em"]}]})
    rows = read_results(EvalRunner(cfg).run())
    by = {(r["method"], r["sample_id"]): r for r in rows}
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows)
    assert {by[("base", "s0")]["method_hash"], by[("rl", "s0")]["method_hash"]} == {
        cfg.method_hash(m) for m in cfg.methods}
    # greedy: both samples answer alike within a method; the adapter changes what the model wrote
    assert by[("base", "s0")]["response"] == by[("base", "s1")]["response"]
    assert by[("base", "s0")]["response"] != by[("rl", "s0")]["response"]


def test_a_resume_with_another_adapter_is_refused(tmp_path, smollm2_lora, make_smollm2_lora):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "question": "What is the secret code?", "context": DOC}) + "\n")
    out = tmp_path / "preds.jsonl"
    other = tmp_path / "other" / "random.gguf"  # the same file name in another folder
    other.parent.mkdir()
    make_smollm2_lora(other, seed=1)
    base = ["run", "-i", str(inp), "-o", str(out), "--chunk-tokens", "100", "--memory-tokens", "16",
            "--final-tokens", "8", "--n-ctx", "1024", "--temperature", "0", "--threads", "1"]
    r = CliRunner().invoke(app, base + ["--lora", smollm2_lora])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, base + ["--lora", str(other), "--resume"])
    assert r.exit_code == 2 and "lora_sha256" in r.output, r.output


def test_a_resume_after_another_adapter_was_copied_over_the_same_path_is_refused(tmp_path, make_smollm2_lora):
    """The backend's name records the adapter's path only; the rows' lora_sha256 catches a swapped file."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": k, "question": "What is the secret code?", "context": DOC}) + "\n"
                           for k in ("a", "b")))
    out, adapter = tmp_path / "preds.jsonl", tmp_path / "adapter.gguf"
    make_smollm2_lora(adapter, seed=0)
    base = ["run", "-o", str(out), "--lora", str(adapter), "--chunk-tokens", "100", "--memory-tokens", "16",
            "--final-tokens", "8", "--n-ctx", "1024", "--temperature", "0", "--threads", "1"]
    one = tmp_path / "one.jsonl"
    one.write_text(inp.read_text().splitlines()[0] + "\n")
    r = CliRunner().invoke(app, base + ["-i", str(one)])
    assert r.exit_code == 0, r.output
    row = json.loads(out.read_text())
    assert row["settings"]["lora_sha256"] == hashlib.sha256(adapter.read_bytes()).hexdigest()
    before = out.read_bytes()
    # the same bytes by another spelling of the path: accepted (and nothing left to run for that sample)
    r = CliRunner().invoke(app, base[:4] + [f"{adapter.parent}/./{adapter.name}"] + base[5:] + ["-i", str(one), "--resume"])
    assert r.exit_code == 0 and out.read_bytes() == before, r.output
    make_smollm2_lora(adapter, seed=1)  # retrained, same path
    r = CliRunner().invoke(app, base + ["-i", str(inp), "--resume"])
    assert r.exit_code == 2 and "lora_sha256" in r.output, r.output
    assert out.read_bytes() == before  # the rows already made are kept as they were
