"""run.rollout_engine=vllm: the trainer starts an engine from the policy's weights and pushes the updated
weights into it after every step and on resume. vllm is replaced by a double (CI has no vllm) that records
what it is given and answers with scripted token ids."""

import sys
import types
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.train.config import load_config  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN = needle_samples(4, 12, seed=0, prefix="t")
VAL = {1: needle_samples(1, 12, seed=1, prefix="v")}


class EngineModel:
    def __init__(self):
        self.loads = []

    def load_weights(self, weights):
        self.loads.append({k: v.clone() for k, v in weights})


class FakeLLM:
    """Answers prompt k of each call with k % 3 + 1 copies of one token, then the end-of-turn token."""

    made = []

    def __init__(self, **kwargs):
        from transformers import AutoTokenizer

        self.kwargs = kwargs
        tok = AutoTokenizer.from_pretrained(kwargs["model"])
        self.word, self.end = tok.encode("x", add_special_tokens=False)[0], tok.convert_tokens_to_ids("<|im_end|>")
        self.model, self.resets, self.prompts = EngineModel(), 0, 0
        FakeLLM.made.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        self.prompts += len(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[self.word] * (k % 3 + 1) + [self.end],
                                                          finish_reason="stop", stop_reason=None)])
                for k in range(len(prompts))]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self.model.load_weights(kwargs["weights_iterator"])

    def reset_prefix_cache(self):
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM
    mod.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    FakeLLM.made = []
    yield
    FakeLLM.made = []


def parity_reward(response, answers):
    return float(len(response) % 2)


def _trainer(out, *extra):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}", "run.total_steps=2", "run.save_every=1", "run.val_every=0",
        "run.val_before_train=false", "run.tensorboard=false", "rl.group_size=2", "rl.prompts_per_step=2",
        "agent.chunk_tokens=48", "agent.memory_tokens=6", "agent.final_tokens=6", "optim.lr=1e-2",
        "optim.warmup_steps=0", "run.rollout_engine=vllm", "run.vllm_gpu_memory_utilization=0.25", *extra,
    ])
    return Trainer(cfg, train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_engine_starts_from_the_policy_and_gets_every_update(fake_vllm, tmp_path):
    import os

    t = _trainer(tmp_path / "run")
    (llm,) = FakeLLM.made
    assert llm.kwargs["model"] == str(tmp_path / "run" / "rollout_init")
    assert (llm.kwargs["dtype"], llm.kwargs["gpu_memory_utilization"], llm.kwargs["generation_config"]) == (
        "float32", 0.25, "vllm")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the model lives in this process
    start = _params(t.policy)
    t.train_step()
    assert llm.prompts > 0 and len(llm.model.loads) == 1 and llm.resets == 1
    pushed, now = llm.model.loads[0], _params(t.policy)
    assert pushed.keys() == now.keys()
    assert all(torch.equal(pushed[k], now[k]) for k in now)
    assert any(not torch.equal(start[k], now[k]) for k in now)  # the step changed the weights it pushed


def test_resume_pushes_the_checkpoint_weights(fake_vllm, tmp_path):
    first = _trainer(tmp_path / "run", "run.stop_after_step=1")
    first.fit()
    trained = _params(first.policy)
    FakeLLM.made = []
    resumed = _trainer(tmp_path / "run")
    (llm,) = FakeLLM.made
    assert resumed.step == 1 and len(llm.model.loads) == 1
    assert all(torch.equal(llm.model.loads[0][k], trained[k]) for k in trained)
