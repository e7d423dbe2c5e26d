"""``memagent export RUN_DIR --out DIR [--format hf|gguf|lora-gguf] [--checkpoint STEP]``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import typer

from memagent.errors import MemagentError


def export_command(
    run_dir: Path = typer.Argument(..., help="training run folder (holds policy/ or adapter/, and config.json)"),
    out: Path = typer.Option(..., "--out", "-o", help="new or empty folder to write into"),
    fmt: str = typer.Option("hf", "--format", "-f", help="hf (model directory, LoRA merged) | gguf (OUT/model.gguf "
                            "for llama.cpp) | lora-gguf (OUT/adapter.gguf, llama.cpp's LoRA format)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="tensor type f16 | f32; default f16 for gguf (a model's norms stay f32), f32 for lora-gguf (the adapter exactly; f16 halves the file)"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", "-c", help="export a kept step instead of the "
                                             "newest policy: a step number (RUN_DIR/checkpoints/step_*.pt) or a checkpoint file"),
) -> None:
    """Export a run's trained policy (or an earlier kept step) as an HF model directory, a GGUF, or a llama.cpp LoRA adapter."""
    from memagent.export.run import StaleExportWarning, export_run

    shown = warnings.showwarning

    def show(message, category, *args, **kwargs):  # ours as one line on stderr; the libraries' as they come
        if issubclass(category, StaleExportWarning):
            typer.secho(f"warning: {message}", fg="yellow", err=True)
        else:
            shown(message, category, *args, **kwargs)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", StaleExportWarning)
            warnings.showwarning = show
            written = export_run(run_dir, out, fmt, dtype, checkpoint)
    except MemagentError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from e
    typer.echo(written)
