"""`memagent run` against two local fake servers (issue 16): one killed mid-run, then both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _server(latency_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "memagent.backends.fakeserver", "--latency", str(latency_s)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline().split()[-1])}/v1"


@pytest.fixture
def servers():
    procs = []

    def start(latency_s=0.05):
        proc, url = _server(latency_s)
        procs.append(proc)
        return proc, url

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _run(tmp_path, urls, n=24):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{k}", "question": "Who?", "context": f"Line {k}. " * 400}) + "\n"
                           for k in range(n)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "memagent", "run", "--backend", "openai", "--model", "fake", "--tokenizer", "bytes",
           "--chunk-tokens", "600", "--memory-tokens", "64", "--final-tokens", "16", "--concurrency", "4",
           "--max-retries", "1", "--input", str(inp), "--output", str(out)]
    for u in urls:
        cmd += ["--base-url", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    return proc, out


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


def _wait_rows(out: Path, n: int, proc) -> None:
    deadline = time.monotonic() + 60
    while len(_rows(out)) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def test_one_of_two_servers_killed_mid_run_loses_no_sample(tmp_path, servers):
    (a, url_a), (b, url_b) = servers(), servers()
    proc, out = _run(tmp_path, [url_a, url_b])
    _wait_rows(out, 4, proc)
    b.kill()
    stdout, stderr = proc.communicate(timeout=120)
    rows = _rows(out)
    assert proc.returncode == 0, stderr
    assert sorted(r["sample_id"] for r in rows) == sorted(f"s{k}" for k in range(24))  # every sample once
    assert all(r["status"] == "ok" for r in rows)
    summary = next(x for x in stderr.splitlines() if x.startswith("requests per server: "))
    assert f"{url_b} " in summary and "out of the rotation" in summary, summary


def test_an_unreachable_server_is_skipped_and_all_down_stops_keeping_rows(tmp_path, servers):
    (a, url_a) = servers(latency_s=0.1)
    proc, out = _run(tmp_path, [url_a, "http://127.0.0.1:9/v1"])
    _wait_rows(out, 3, proc)
    a.kill()
    stdout, stderr = proc.communicate(timeout=120)
    assert "warning" in stderr.lower() and "cannot reach http://127.0.0.1:9/v1" in stderr
    assert proc.returncode == 2, stderr
    assert "none of the 2 servers answers" in stderr and "rows already written are kept" in stderr
    rows = _rows(out)
    assert 3 <= len(rows) < 24 and all(r["status"] == "ok" for r in rows)
    summary = next(x for x in stderr.splitlines() if x.startswith("requests per server: "))  # how far each got
    assert summary.startswith(f"requests per server: {url_a} ") and "out of the rotation" in summary, summary
    assert len({r["sample_id"] for r in rows}) == len(rows)


def test_eval_grid_with_two_servers_one_unreachable(tmp_path, servers):
    from memagent.data.io import write_samples
    from memagent.types import Sample

    (_, url) = servers(latency_s=0.01)
    data = tmp_path / "q.jsonl"
    write_samples(data, [Sample(f"q{k}", "Q?", f"document {k} " * 50, ("fake",)) for k in range(3)])
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(f"output: {tmp_path / 'run'}\ntokenizer: bytes\n"
                   f"backend: {{name: openai, model: fake, base_url: [{url}, 'http://127.0.0.1:9/v1'], context_tokens: 4096}}\n"
                   "methods: [{name: m, chunk_tokens: 300, memory_tokens: 64, final_tokens: 16}]\n"
                   f"tasks: [{{name: t, lengths: ['1'], samples: 3, files: {{1: {data}}}, metrics: [sub_em]}}]\n")
    r = subprocess.run([sys.executable, "-m", "memagent", "eval", "--config", str(cfg), "--no-report"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cannot reach http://127.0.0.1:9/v1" in r.stderr
    assert f"openai:fake: requests per server: {url} 9, http://127.0.0.1:9/v1 0 (out of the rotation)" in r.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(x["status"] == "ok" and x["score"] == 1.0 for x in rows)
