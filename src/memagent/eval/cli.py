"""`memagent eval` and `memagent report` as plain typer-compatible functions (the main CLI mounts them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from memagent.configtypes import parse_ints
from memagent.errors import MemagentError
from memagent.options import agent_group, backend_group, refuse_unused_backend_options, with_settings

#: ``--max-new-tokens``'s default (the direct baseline's answer cap).
MAX_NEW_TOKENS_DEFAULT = 256

#: eval's agent options: every agent setting (the memory agent's budgets; sampling and seed for the whole grid).
EVAL_AGENT = agent_group()


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg="red", err=True)
    raise typer.Exit(2)


def _flags_config(tasks: str, lengths: str | None, methods: str, samples: int, output: Path, agent, backend,
                  max_input_tokens: Optional[int], max_new_tokens: int, data_root: Optional[Path]):
    """The grid the command-line flags describe: the memory agent and/or the direct baseline, over the tasks.

    Args:
        agent: the agent's settings (:class:`memagent.agent.config.AgentConfig`); sampling and seed apply to the
            whole grid, budgets to the memory agent, ``batch_size`` and extra sampling settings to both methods.
        backend: the backend options (:class:`memagent.backends.factory.BackendOptions`).
    """
    from memagent.configtypes import flat_dict
    from memagent.errors import ConfigError
    from memagent.eval.grid import GRID_SAMPLING, EvalConfig

    method_keys = [k for k in flat_dict(agent) if k not in GRID_SAMPLING]
    agent_keys = {k: v for k, v in flat_dict(agent).items() if k in method_keys}
    shared = {"batch_size": agent.batch_size, **agent.sampling_options()}
    method_list = []
    for m in [x.strip() for x in methods.split(",") if x.strip()]:
        if m in ("memagent", "memory_agent"):
            method_list.append({"name": "memagent", "kind": "memory_agent", **agent_keys})
        elif m == "direct":
            method_list.append({"name": "direct", "kind": "direct", "max_input_tokens": max_input_tokens,
                                "max_new_tokens": max_new_tokens, **shared})
        else:
            raise ConfigError(f"--methods: unknown method {m!r}; use memagent and/or direct (or a --config grid)")
    unused = _flags_of_absent_kind({m["kind"] for m in method_list}, agent, max_input_tokens, max_new_tokens)
    if unused:
        typer.secho(unused, fg="yellow", err=True)
    refuse_unused_backend_options(backend.backend)
    backend_cfg = backend.settings()
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if "hotpotqa" in names and len(names) > 1:
        raise ConfigError(f"--tasks {tasks}: --lengths is shared by every task, but hotpotqa counts documents and the "
                          "other tasks count tokens; run hotpotqa separately, or give each task its lengths in a "
                          "--config grid")
    if lengths is None:  # each unit's own default: 50 documents, or 8K tokens
        lengths = "50" if names == ["hotpotqa"] else "8K"
    task_list = [{"name": t, "lengths": parse_ints(lengths, "--lengths", suffix=t != "hotpotqa"), "samples": samples}
                 for t in names]
    return EvalConfig.from_dict({
        "name": output.name, "output": str(output), "seed": agent.seed, "temperature": agent.temperature,
        "top_p": agent.top_p, "backend": backend_cfg, "tokenizer": backend.tokenizer,
        "data_root": None if data_root is None else str(data_root), "methods": method_list, "tasks": task_list,
    }, "command line")


#: Flags that still apply with --config (the rest come from the grid file).
CONFIG_COMPATIBLE_FLAGS = {"config", "output", "retry_errors", "no_report", "only", "only_methods"}



def _flags_of_absent_kind(kinds: set[str], agent, max_input_tokens: int | None, max_new_tokens: int) -> str | None:
    """A warning for flags that only a method kind the grid lacks would use (``--methods direct --chunk-tokens
    100``), else None. Not an error: the same command line run with fewer ``--methods`` (a grid in pieces) is a
    normal way to continue a run."""
    from memagent.eval.grid import agent_only_settings_given

    unused = []
    if "memory_agent" not in kinds:
        unused += [f"--{k.replace('_', '-')}" for k in agent_only_settings_given(agent)]
    if "direct" not in kinds:
        unused += (["--max-input-tokens"] if max_input_tokens is not None else []) + \
            (["--max-new-tokens"] if max_new_tokens != MAX_NEW_TOKENS_DEFAULT else [])
    if not unused:
        return None
    need = "memagent" if "memory_agent" not in kinds else "direct"
    return (f"warning: {', '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} to --methods {need} only, which "
            f"this run does not include, so {'it is' if len(unused) == 1 else 'they are'} not used")


@with_settings(EVAL_AGENT, backend_group())
def eval_command(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML grid (configs/eval_*.yaml); then only --output, --only, --only-methods, --retry-errors and --no-report apply"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="run folder (default: the config's output, or runs/eval)"),
    tasks: str = typer.Option("hotpotqa", "--tasks", "-t", help="hotpotqa, or comma-separated RULER tasks (hotpotqa runs alone: its lengths count documents; a --config grid can mix them)"),
    lengths: Optional[str] = typer.Option(None, "--lengths", "-l", help="hotpotqa: numbers of documents (default 50); RULER: tokens, e.g. 8K,16K (default 8K)"),
    methods: str = typer.Option("memagent,direct", "--methods", help="memagent and/or direct"),
    samples: int = typer.Option(16, "--samples", "-n", min=1, help="samples per (task, length)"),
    max_input_tokens: Optional[int] = typer.Option(None, "--max-input-tokens", min=1, help="direct: prompt cap (default: window - answer cap)"),
    max_new_tokens: int = typer.Option(MAX_NEW_TOKENS_DEFAULT, "--max-new-tokens", min=1, help="direct: answer cap"),
    data_root: Optional[Path] = typer.Option(None, "--data-root", help="data folder (default: $MEMAGENT_DATA, else ../shared/data)"),
    retry_errors: bool = typer.Option(False, "--retry-errors", help="re-run samples whose earlier row is an error"),
    no_report: bool = typer.Option(False, "--no-report", help="skip writing the report (summary.md/csv, accuracy.png, report.html) at the end"),
    only: Optional[list[str]] = typer.Option(None, "--only", help="run only these cells now, e.g. 'vt:8K,hotpotqa' (task[:length], comma-separated or the flag repeated); the rest stay for a later call"),
    only_methods: Optional[list[str]] = typer.Option(None, "--only-methods", help="run only these of the grid's methods now, e.g. 'direct' (comma-separated names or the flag repeated); the rest stay for a later call"),
    agent_config=None, backend_options=None,
):
    """Evaluate methods over tasks and lengths; resumable (re-run the same command to continue)."""
    from dataclasses import replace

    from memagent.eval.grid import EvalConfig
    from memagent.eval.report import write_report
    from memagent.eval.runner import EvalRunner

    try:
        if config is not None:
            ignored = [p.opts[0] for p in ctx.command.params if p.name not in CONFIG_COMPATIBLE_FLAGS
                       and p.opts and ctx.get_parameter_source(p.name) is not None
                       and ctx.get_parameter_source(p.name).name == "COMMANDLINE"]
            if ignored:
                typer.secho(f"warning: {', '.join(ignored)} ignored: --config {config} sets these (edit the grid "
                            "file instead)", fg="yellow", err=True)
            cfg = EvalConfig.from_yaml(config)
            if output is not None:
                cfg = replace(cfg, output=str(output))
        else:
            from memagent.options import apply_policy

            # a packaged policy (--lora ruler-niah) brings the budgets it was trained with, as in `run` and `demo`
            agent_config = apply_policy(agent_config, backend_options)
            cfg = _flags_config(tasks, lengths, methods, samples, output or Path("runs/eval"), agent_config,
                                backend_options, max_input_tokens, max_new_tokens, data_root)
        runner = EvalRunner(cfg, log=lambda msg: typer.echo(msg, err=True), retry_errors=retry_errors)
        # a repeated flag adds to the earlier ones (it used to replace them silently)
        results = runner.run(_parse_only(",".join(only)) if only else None,
                             [x.strip() for x in ",".join(only_methods).split(",") if x.strip()] if only_methods else None)
        typer.echo(str(results))
        if not no_report:
            for p in write_report([cfg.output], tokenizer=runner.tokenizer):
                typer.echo(str(p))
        from memagent.eval.metrics import read_results

        rows = read_results(results)
        failed = sum(r["status"] == "error" for r in rows)
    except MemagentError as e:
        _fail(e)
    if failed:  # like `memagent run`: exit status 1 when any sample failed (the rows are kept and counted)
        from memagent.runfiles import NOT_RUN

        refused = sum(r["status"] == "error" and str(r.get("error") or "").startswith(NOT_RUN) for r in rows)
        why = (f"; {refused} of them were not run, their question being too long for the method's budget (see "
               "each row's error): a retry alone refuses them again") if refused else ""
        typer.secho(f"{failed} of {len(rows)} samples failed (status=error rows in {results}; they score 0; "
                    f"rerun with --retry-errors to try them again{why})", fg="yellow", err=True)
        raise typer.Exit(1)


def _parse_only(text: str) -> list[tuple[str, int | None]]:
    """``'vt:8K,hotpotqa:50'`` -> ``[("vt", 8192), ("hotpotqa", 50)]``; a bare task name means all its lengths."""
    out: list[tuple[str, int | None]] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, length = item.partition(":")
        out.append((name.strip(), parse_ints(length, "--only")[0] if length else None))
    if not out:
        from memagent.errors import ConfigError

        raise ConfigError("--only: name at least one cell, e.g. --only vt:8K,hotpotqa")
    return out


def report_command(
    runs: list[Path] = typer.Argument(..., help="run folders (each with results.jsonl)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder (default: the run folder itself; required when comparing several runs)"),
    no_plot: bool = typer.Option(False, "--no-plot", help="no accuracy plot: the tables and report.html only (an earlier accuracy.png is removed)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="the runs' tokenizer spec (e.g. smollm2, bytes), to "
                                            "recompute which part of each document a prompt kept: needed for every direct "
                                            "row, and for memory-agent rows of a method with max_context_tokens that have no "
                                            "trace or one without context_chars. Default: the one each run's manifest records, when loadable "
                                            "(the grid's tokenizer: setting, bytes, or a SmolLM2-135M-Instruct GGUF file "
                                            "name); without one those rows' read % is n/a and they count as not measured. "
                                            "One other than the manifest records is warned about"),
):
    """Tables (Markdown, CSV), an accuracy-vs-length plot and report.html (memory diagnostics, per-sample memory
    timelines) from result files only."""
    from memagent.eval.report import write_report

    try:
        tok = None
        if tokenizer is not None:
            from memagent.eval.run_diagnostics import tokenizer_mismatch
            from memagent.runfiles import read_manifest
            from memagent.tokenization import load_tokenizer

            tok = load_tokenizer(tokenizer)
            for run in runs:
                recorded = tokenizer_mismatch(read_manifest(run / "manifest.json"), tokenizer, tok)
                if recorded is not None:
                    typer.secho(f"warning: --tokenizer {tokenizer} ({tok.name}) is not the tokenizer {run} recorded "
                                f"({recorded}); its evidence numbers (read %, outcomes) are computed with --tokenizer's "
                                "and may differ from the run's own", fg="yellow", err=True)
        for p in write_report(runs, out, plot=not no_plot, tokenizer=tok):
            typer.echo(str(p))
    except MemagentError as e:
        _fail(e)
