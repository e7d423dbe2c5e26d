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

    def start():
        proc = subprocess.Popen([sys.executable, "-m", "memagent.backends.fakeserver", "--latency", "0",
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
    return Trainer(cfg, train_samples=needle_samples(4, 12, 0, "t"), val_samples={},
                   reward_fn=lambda r, a: float(len(r) % 2))


def test_rollouts_on_two_servers_with_the_adapter_loaded_every_step(tmp_path, servers):
    start, tok, eos = servers
    (p1, u1), (p2, u2) = start(), start()
    t = _trainer(tmp_path, [u1, u2])
    first = t.backend.adapter[0]
    assert all(_stats(u)["adapters"] == [first] for u in (u1, u2))  # published at start, before any rollout
    m = t.train_step()
    assert m["conv/per_traj_mean"] > 1  # several chunks + the final answer per trajectory
    second = t.backend.adapter[0]
    assert second != first
    for u in (u1, u2):  # the new adapter replaced the old one on both servers
        assert _stats(u)["adapters"] == [second]
    served = {u: _stats(u)["by_model"] for u in (u1, u2)}
    assert set().union(*served.values()) == {first}  # step 1's rollouts all ran on the adapter of step 0
    assert all(sum(v.values()) > 0 for v in served.values())  # both servers took requests
    # the rows are the servers' exact token ids: the memory reply's tokens and the end-of-sequence id
    reply = tok("Memory: nothing relevant so far.", add_special_tokens=False)["input_ids"] + [eos]
    from memagent.train.rollout import collect_rollouts
    rows = collect_rollouts(t.agent(1.0, 1.0, 0), t.train_samples[:1], 2).rows
    assert [list(r.response_ids) for r in rows if not r.is_final][0] == reply

    # one server killed between steps: the next step runs on the other one, every trajectory complete
    p2.kill()
    p2.wait()
    with pytest.warns(UserWarning, match="cannot reach"):
        m2 = t.train_step()
    assert m2["conv/per_traj_min"] == m["conv/per_traj_min"]
    assert t.backend.pool.stats()[u2]["up"] is False
    assert _stats(u1)["adapters"] == [t.backend.adapter[0]]
    assert not (tmp_path / "run" / "rollout_adapters" / first).exists()  # only the last two folders are kept
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
