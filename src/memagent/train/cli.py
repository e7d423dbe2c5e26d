"""``memagent train --config configs/<preset>.yaml key=value ...`` (also ``python -m memagent.train.cli``,
which is what ``torchrun`` launches)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from memagent.errors import MemagentError


def train_command(
    config: str = typer.Option(..., "--config", "-c", help="training preset YAML (configs/train_*.yaml)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="dotted overrides, e.g. rl.group_size=4 optim.lr=1e-5"),
) -> None:
    """Train the memory policy with multi-conversation GRPO (single process, or under torchrun)."""
    from memagent.train.config import load_config
    from memagent.train.distributed import init_distributed, shutdown
    from memagent.train.trainer import Trainer

    try:
        cfg = load_config(config, list(overrides or []))
        info = init_distributed(cfg.run.dist_timeout_s)
        trainer = Trainer(cfg, info)
        last = trainer.fit()
        if info.is_main:
            if last:
                typer.echo(json.dumps(last, indent=None))
            else:
                typer.echo(f"nothing to do: {cfg.run.output_dir} is at step {trainer.step} of run.total_steps="
                           f"{cfg.run.total_steps} (raise run.total_steps to train further)", err=True)
        trainer.close()  # after the last collective: a vLLM engine tears down its process groups
        shutdown()
    except MemagentError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from e


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False)
    app.command()(train_command)
    app(args=argv if argv is not None else sys.argv[1:], standalone_mode=True)


if __name__ == "__main__":
    main()
