"""The memory agent's settings: declared here once, embedded by eval methods and the training config.

Every field is declared with :func:`memagent.configtypes.setting`: its help line, command-line flag and lower
bound live next to its default, so ``memagent run``/``demo``/``eval`` options (:mod:`memagent.options`), eval
grid keys (:class:`memagent.eval.grid.MethodConfig`) and the training config's ``agent:`` section
(:class:`memagent.train.config.AgentSettings`) all come from this one class. A field declared with
``sampling=True`` is an extra sampling setting: the agent passes it to the backend in ``Request.sampling`` when
it is off its default, and :mod:`memagent.backends.sampling` maps it to each engine's own name (or the backend
refuses it). Adding such a setting takes one field here and one entry in that table.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from memagent.configtypes import check_bounds, check_sampling, coerce_fields, setting
from memagent.errors import ConfigError


@dataclass(frozen=True)
class AgentConfig:
    """Settings of the memory agent. All lengths are in model tokens.

    Attributes:
        chunk_tokens: tokens of document per update call (reference: 5000).
        memory_tokens: cap on the memory, enforced as the update call's max new tokens (reference: 1024).
        final_tokens: cap on the final answer's new tokens (reference: 1024; the reference's sync trainer
            wrongly used the memory cap here, bug list item 2).
        max_context_tokens: optional center truncation of the document (first and last halves kept);
            ``None`` reads everything (the reference eval default).
        temperature, top_p: sampling settings (temperature 0 = greedy).
        seed: base sampling seed; each request gets a seed derived from (seed, sample id, turn) so repeated
            samples (RL groups) still differ. ``None``: backend default.
        batch_size: samples advanced together (one request each per step).
        repetition_penalty: the engines' repetition penalty (1 = off): logits of tokens already seen are divided
            by it (multiplied when negative); an extra sampling setting, refused by backends that lack it.
        templates: a YAML file of prompt templates (``None``: the built-in ones).
        strict: raise :class:`BackendError` on the first failed request instead of recording it.
        slack_tokens: allowance for re-tokenising chunk and memory texts inside a prompt (a boundary can
            merge differently than in the whole document).
    """

    chunk_tokens: int = setting(5000, "document tokens per chunk", min=1)
    memory_tokens: int = setting(1024, "memory cap in tokens (max new tokens of an update)", min=1)
    final_tokens: int = setting(1024, "max new tokens of the final answer", min=1)
    max_context_tokens: int | None = setting(None, "center-truncate documents to this many tokens (default: read all)",
                                             min=2)
    temperature: float = setting(0.0, "sampling temperature (0 = greedy)", min=0.0)
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest token set of this probability mass, in (0, 1]")
    seed: int | None = setting(None, "sampling seed (each request's seed derives from it, the sample id and the turn)",
                               cli_default=0)
    batch_size: int = setting(8, "samples advanced together", min=1)
    repetition_penalty: float = setting(1.0, "penalty on tokens already in the prompt or output (1 = off; >1 "
                                        "discourages repeats)", gt=0.0, sampling=True)
    templates: str | None = setting(None, "YAML file with update/final/no_memory/system prompts")
    strict: bool = setting(False, "stop at the first failed request instead of recording it", cli=False)
    slack_tokens: int = setting(16, "allowance for re-tokenising chunk and memory texts inside a prompt", min=0,
                                cli=False)

    def __post_init__(self):
        if isinstance(self.templates, os.PathLike):  # a pathlib.Path, as PromptTemplates.from_file takes it
            object.__setattr__(self, "templates", os.fspath(self.templates))
        if self.templates == "":
            raise ConfigError("templates is an empty string: give a YAML file or a built-in name, or None for the "
                              "built-in default")
        coerce_fields(self)
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ConfigError(f"max_context_tokens must be >= 2 or None, got {self.max_context_tokens}")
        check_sampling(self.temperature, self.top_p)
        check_bounds(self)

    def prediction_settings(self) -> dict[str, Any]:
        """What a prediction depends on among these settings (``memagent run`` records it in every row and
        ``--resume`` compares it): every setting except :data:`NOT_PREDICTIVE`, the extra sampling settings only
        when off their default. The prompt templates count by their text's hash, recorded by the caller."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in NOT_PREDICTIVE and not f.metadata.get("sampling")} | self.sampling_options()

    def sampling_options(self) -> dict[str, Any]:
        """The extra sampling settings that are off their default, by name (what ``Request.sampling`` carries)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("sampling") and getattr(self, f.name) != f.default}


#: Settings that decide how a run proceeds, not what it predicts.
NOT_PREDICTIVE = ("batch_size", "templates", "strict", "slack_tokens")


def sampling_defaults() -> dict[str, Any]:
    """Default of each extra sampling setting (declared with ``sampling=True``), by name."""
    return {f.name: f.default for f in dataclasses.fields(AgentConfig) if f.metadata.get("sampling")}
