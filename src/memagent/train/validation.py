"""Validation during training: the current policy through the eval runner, one cell per length multiplier."""

from __future__ import annotations

import dataclasses
import os

from memagent.errors import ConfigError
from memagent.train.config import TrainConfig


def validate(cfg: TrainConfig, backend, val_samples: dict[int, list], step: int) -> dict[str, float]:
    """Evaluate the current policy on the validation questions through the eval runner.

    Runs :class:`memagent.eval.runner.EvalRunner` with one memory-agent method (the training run's agent
    settings, ``agent.val_temperature``/``val_top_p``, greedy by default) on the rollout backend, one cell per
    length multiplier ``m`` (the questions, with their length in tokens, go to ``val/data/x{m}.jsonl``). Rows and
    memory traces go to ``val/step_{step:06d}/`` (readable by ``memagent report``; cells are keyed by the mean
    document length in tokens); a failed request is an error row that scores 0, and a validation cut short by a
    kill resumes with its finished rows.

    Args:
        cfg: the training configuration.
        backend: the rollout backend (on the current policy).
        val_samples: length multiplier -> questions.
        step: the training step validated (names the folder).

    Returns:
        ``val/x{m}/reward`` (the configured reward, ``rl.reward``), ``val/x{m}/sub_em`` (on the extracted
        answer), ``val/x{m}/boxed`` (fraction of answers in a box) and ``val/x{m}/n_error`` per ``m``; and the
        memory diagnostics of the step's folder (:func:`memagent.eval.run_diagnostics.validation_metrics`:
        ``val/x{m}/captured_pct``, ``retained_pct``, the outcome shares, ``cap_hit_pct``, ``memory_tokens_mean``...;
        those not measured are left out), so a learning run shows capture and retention over steps.

    Raises:
        ConfigError: two multipliers give documents of one mean length, or the folder holds rows made with
            other settings.
    """
    from memagent.data.io import write_samples
    from memagent.eval.grid import EvalConfig, MethodConfig, TaskConfig
    from memagent.eval.run_diagnostics import validation_metrics
    from memagent.eval.runner import EvalRunner
    from memagent.runfiles import read_results
    from memagent.tokenization import count_tokens

    mults = [m for m, samples in sorted(val_samples.items()) if samples]
    if not mults:
        return {}
    out_dir = cfg.run.output_dir
    files, tokens = {}, {}  # cells are keyed by their mean document length in tokens (the report's x axis)
    tok = backend.tokenizer
    for m in mults:
        path = os.path.join(out_dir, "val", "data", f"x{m}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        samples = [dataclasses.replace(s, metadata={**s.metadata, "length_tokens": count_tokens(tok, s.context),
                                                    "tokenizer": tok.name, "length_multiplier": m})
                   for s in val_samples[m]]
        write_samples(path, samples)
        tokens[m] = round(sum(s.metadata["length_tokens"] for s in samples) / len(samples))
        files[tokens[m]] = path
    if len(set(tokens.values())) != len(tokens):
        raise ConfigError(f"validation multipliers {mults} give documents of the same mean length in tokens")
    reward = cfg.rl.reward
    metrics = (reward,) if reward == "sub_em" else (reward, "sub_em")
    method = MethodConfig(name="policy", kind="memory_agent", agent=cfg.agent.rollout)
    task = TaskConfig(name="val", lengths=tuple(tokens[m] for m in mults), files=files, metrics=metrics,
                      samples=max(len(val_samples[m]) for m in mults))
    out = os.path.join(out_dir, "val", f"step_{step:06d}")
    ecfg = EvalConfig(methods=(method,), tasks=(task,), name=f"validation step {step}", output=out,
                      seed=cfg.run.seed, temperature=cfg.agent.val_temperature, top_p=cfg.agent.val_top_p,
                      backend={"name": "hf", "model": cfg.model.path, "step": step})  # a label: the hash's backend
    try:
        rows = read_results(EvalRunner(ecfg, backend=backend, tokenizer=backend.tokenizer).run())
    except ConfigError as e:  # rows of an earlier start of this run, made with other settings
        raise ConfigError(f"validation at step {step}: {out} holds rows this run cannot continue ({e}). "
                          f"Delete {out} to validate again, or restore the earlier settings") from None
    res: dict[str, float] = {}
    for m in mults:
        rs = [r for r in rows if int(r["length"]) == tokens[m]]
        n = len(rs)
        res[f"val/x{m}/reward"] = sum(r["scores"][reward] for r in rs) / n
        res[f"val/x{m}/sub_em"] = sum(r["scores"]["sub_em"] for r in rs) / n
        res[f"val/x{m}/boxed"] = sum(r["extraction"] == "boxed" for r in rs) / n
        res[f"val/x{m}/n_error"] = float(sum(r["status"] == "error" for r in rs))
    res.update(validation_metrics(out, {tokens[m]: f"val/x{m}" for m in mults}, method="policy"))
    return res
