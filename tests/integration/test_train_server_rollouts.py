"""Training rollouts on OpenAI-compatible servers that load the LoRA adapter at run time (issue 16,
``run.rollout_engine=servers``), against two local fake servers speaking vLLM's run-time LoRA API: every step
publishes a new adapter to both, rollout requests name it and come back with exact token ids, and a server
killed between steps leaves the rotation without losing a trajectory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memagent.errors import BackendError, ConfigError  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.tiny import make_tiny_tokenizer  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def servers(tmp_path):
    tok = make_tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    procs = []

    def start(port: int = 0):
        proc = subprocess.Popen([sys.executable, "-m", "memagent.backends.fakeserver", "--latency", "0.05",
                                 "--port", str(port), "--strict-models",
                                 "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"), "--eos-id", str(eos)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
        procs.append(proc)
        return proc, f"http://127.0.0.1:{int(proc.stdout.readline().split()[-1])}/v1"

    yield start, tok, eos
    for p in procs:
        p.kill()
        p.wait()


def _stats(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/stats") as r:
        return json.loads(r.read())


def _trainer(tmp_path, urls, lora=True):
    over = [f"run.output_dir={tmp_path / 'run'}", "run.resume=false", "run.rollout_engine=servers",
            f"run.rollout_servers=[{','.join(urls)}]", "rl.group_size=2", "rl.prompts_per_step=2",
            "rl.mini_batches=1", "agent.chunk_tokens=40", "agent.memory_tokens=12", "agent.final_tokens=8",
            "agent.batch_size=4", "run.val_every=0"]
    if lora:
        over += ["model.lora.enabled=true", "model.lora.rank=4"]
    cfg = load_config("configs/train_cpu_small.yaml", over)
    return Trainer(cfg, train_samples=needle_samples(8, 12, 0, "t"), val_samples={},
                   reward_fn=lambda r, a: float(len(r) % 2))


def _quiet_step(t):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return t.train_step()


def test_rollouts_on_two_servers_with_the_adapter_loaded_every_step(tmp_path, servers):
    start, tok, eos = servers
    (p1, u1), (p2, u2) = start(), start()
    t = _trainer(tmp_path, [u1, u2])
    v0 = t.backend.adapter[0]
    assert all(_stats(u)["adapters"] == [v0] for u in (u1, u2))  # published at start, before any rollout
    m = t.train_step()
    assert m["conv/per_traj_mean"] > 1  # several chunks + the final answer per trajectory
    v1 = t.backend.adapter[0]
    assert v1 != v0
    for u in (u1, u2):  # the new adapter replaced the old one on both servers
        assert _stats(u)["adapters"] == [v1]
    served = {u: _stats(u)["by_model"] for u in (u1, u2)}
    # step 1's rollouts (and the 1-token id check at start) all ran on the adapter of step 0,
    # and both servers took requests (two groups in flight at once go to two servers)
    assert {k for v in served.values() for k in v} == {v0}
    assert all(v.get(v0, 0) > 0 for v in served.values())
    # the rows are the servers' exact token ids: the memory reply's tokens and the end-of-sequence id
    from memagent.train.rollout import collect_rollouts
    rows = collect_rollouts(t.agent(1.0, 1.0, 0), t.train_samples[:1], 2).rows
    reply = tok("Memory: nothing relevant so far.", add_special_tokens=False)["input_ids"] + [eos]
    assert [list(r.response_ids) for r in rows if not r.is_final][0] == reply

    # one server killed between steps: the step completes on the other one (a lost trajectory would raise)
    port2 = int(u2.rsplit(":", 1)[1].split("/")[0])
    p2.kill()
    p2.wait()
    before = _stats(u1)["by_model"].get(v1, 0)
    _quiet_step(t)
    assert t.backend.pool.stats()[u2]["up"] is False
    assert _stats(u1)["by_model"][v1] > before  # step 2 ran on step 1's adapter, on the live server
    v2 = t.backend.adapter[0]
    assert _stats(u1)["adapters"] == [v2]

    # the server comes back empty (a restart, same address): its health check gives it the current adapter
    # before it takes requests, so none of its requests names an adapter it lacks (that would be a 404)
    p2b, u2b = start(port2)
    assert u2b == u2
    t.backend.pool.recheck_s = 0.0
    t.backend.pool.affinity_slack = -1  # plain least-loaded routing: the server takes requests within the step
    t.train_step()  # its first request probes the server back in; a request that met a server without v2 fails
    back = _stats(u2)["by_model"]
    assert back.get(v2, 0) > 0 and set(back) == {v2}
    assert t.backend.pool.stats()[u2]["up"] is True
    assert _stats(u2)["adapters"] == [t.backend.adapter[0]]

    # a restart between two steps that the client does not see as a failure (its kept-alive connection is
    # reopened at once): the server answers 404 for the adapter; it leaves the rotation, gets the adapter back
    # from its health check and serves the rest of the step
    p2b.kill()
    p2b.wait()
    start(port2)
    v4 = t.backend.adapter[0]
    t.train_step()
    back = _stats(u2)["by_model"]
    assert back.get(v4, 0) > 0 and set(back) == {v4}
    assert not (tmp_path / "run" / "rollout_adapters" / v0).exists()  # only the last two folders are kept
    assert (tmp_path / "run" / "rollout_adapters" / t.backend.adapter[0] / "adapter_config.json").is_file()


def test_full_fine_tuning_is_refused_and_no_server_is_a_clear_error(tmp_path, servers):
    start, _, _ = servers
    _, u1 = start()
    with pytest.raises(ConfigError, match="LoRA"):
        _trainer(tmp_path, [u1], lora=False)
    with pytest.raises(BackendError, match="cannot reach"):
        _trainer(tmp_path / "b", ["http://127.0.0.1:9/v1"])
    with pytest.raises(ConfigError, match="rollout_servers"):
        load_config("configs/train_cpu_small.yaml", ["run.rollout_engine=servers"])
