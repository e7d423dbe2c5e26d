"""Built-in prompt templates by name (``templates: chunk_first``) through every place settings enter: an eval
grid's method (not resolved against the grid file's folder), the agent it builds, and the training ``agent:``."""

from __future__ import annotations

from memagent.agent.config import AgentConfig
from memagent.agent.loop import MemoryAgent
from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
from memagent.backends.scripted import ScriptedBackend


def test_an_eval_grid_method_names_a_builtin_template_set(tmp_path):
    from memagent.eval.grid import EvalConfig

    grid = tmp_path / "grid.yaml"
    grid.write_text("backend: {name: scripted}\nmethods:\n  - {name: m, templates: chunk_first}\n"
                    "  - {name: f, templates: mine.yaml}\ntasks: [{name: vt, lengths: [1K]}]\n")
    cfg = EvalConfig.from_yaml(grid)
    builtin, own = cfg.methods
    assert builtin.agent.templates == "chunk_first"  # a name, not tmp_path/chunk_first
    assert own.agent.templates == str(tmp_path / "mine.yaml")  # a file is read from the grid's folder
    agent = MemoryAgent(ScriptedBackend(), cfg.agent_for(builtin))
    assert agent.templates == PromptTemplates.from_file("chunk_first") and agent.templates != DEFAULT_TEMPLATES
    assert cfg.method_hash(builtin) != cfg.method_hash(type(builtin)("m"))  # the template set is in the hash


def test_the_training_agent_names_a_builtin_template_set():
    from memagent.train.config import load_config

    cfg = load_config("configs/train_cpu_small.yaml", ["agent.templates=chunk_first"])
    assert cfg.agent.rollout == AgentConfig(**{**cfg.agent.rollout.__dict__, "templates": "chunk_first"})
    assert PromptTemplates.from_file(cfg.agent.rollout.templates).hash == PromptTemplates.from_file("chunk_first").hash
