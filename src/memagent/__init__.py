"""memagent: answer questions over documents of any length with a fixed-size text memory (MemAgent).

The main entry points, importable from the top level::

    from memagent import AgentConfig, MemoryAgent, make_backend
"""

from memagent.agent.loop import AgentConfig, MemoryAgent
from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
from memagent.backends import make_backend
from memagent.types import Sample, Trajectory, Turn

__version__ = "0.1.0"

__all__ = ["AgentConfig", "DEFAULT_TEMPLATES", "MemoryAgent", "PromptTemplates", "Sample", "Trajectory", "Turn",
           "make_backend", "__version__"]
