"""Learning curves from a training run's ``metrics.jsonl``: a reward-curve PNG and a before/after table.

Reads result files only (like ``memagent report`` for evaluations), so it can be rerun without models:

    python -m memagent.train.curves runs/needle_smollm2 docs/results/train_needle
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from memagent.errors import DataError


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` in file order (a last line torn by a kill is not read).

    Raises:
        DataError: the file is missing, or a complete line is not JSON, not an object or has no whole ``step``
            (names the line).
    """
    from memagent.runfiles import complete_lines

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"no metrics.jsonl in {run_dir}: is it a `memagent train` output directory?")
    rows = []
    for n, line in complete_lines(path):
        if line.strip():
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as e:
                raise DataError(f"{path}:{n}: not JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
                raise DataError(f"{path}:{n}: not a metrics row (a JSON object with a whole 'step'); fix or remove "
                                "that line")
            rows.append(row)
    return rows


def validation_table(rows: list[dict]) -> str:
    """Markdown table of every validation: one line per validated step, one column per ``val/*`` score and the
    memory's capture and retention (:data:`TABLE_METRICS`; the other memory diagnostics stay in ``metrics.jsonl``).
    A validation row with no number among these (all null, or other metrics only) gets no line; a table with
    no line at all reads ``(no validation rows)``."""
    def scored(r: dict, k: str) -> bool:
        return (k.startswith("val/") and k.rsplit("/", 1)[-1] in TABLE_METRICS and isinstance(r[k], (int, float))
                and not isinstance(r[k], bool))

    vals = [r for r in rows if any(scored(r, k) for k in r)]  # a row of nulls or other metrics only: no line
    if not vals:
        return "(no validation rows)\n"
    keys = sorted({k for r in vals for k in r if scored(r, k)})
    head = "| step | " + " | ".join(k[4:] for k in keys) + " |"
    rule = "|---|" + "---|" * len(keys)
    lines = [head, rule]
    for r in vals:
        cells = [_cell(k, r.get(k)) for k in keys]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    mults = sorted({k.split("/")[1] for k in keys})
    return ("\n".join(lines) + "\n\nScores in %; `n_error` is a count of samples. " +
            ", ".join(f"`{m}`: held-out samples at {m[1:]}x" for m in mults) + " the training context length.\n")


#: The ``val/x{m}/...`` metrics of the validation table: the trainer's scores (fractions), the error count, and the
#: memory diagnostics' capture and retention (already percentages).
TABLE_METRICS = ("reward", "sub_em", "boxed", "n_error", "captured_pct", "retained_pct")


def _cell(key: str, value) -> str:
    if not isinstance(value, (int, float)):
        return ""
    if key.endswith("/n_error"):
        return str(int(value))
    return f"{value:.1f}" if key.endswith("_pct") else f"{100 * value:.1f}"


def plot_rewards(rows: list[dict], out_png: str | os.PathLike, window: int = 5) -> None:
    """Training reward per step (points), its moving average over ``window`` steps (line), and validation
    rewards (markers per context multiplier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, "o", ms=3, alpha=0.4, label="train reward (per step)")
    if len(rewards) >= window:
        avg = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(steps[window - 1 :], avg, "-", label=f"train reward ({window}-step mean)")
    val_keys = sorted({k for r in rows for k in r if k.startswith("val/") and k.endswith("/reward")})
    for k in val_keys:
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", label=f"validation {k.split('/')[1]}")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m memagent.train.curves RUN_DIR OUT_DIR")
    try:
        rows = read_metrics(args[0])
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    from memagent.runfiles import folder_problem

    out = Path(args[1])
    if problem := folder_problem(out):
        raise SystemExit(f"error: OUT_DIR {str(out)!r} {problem}; give a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        plot_rewards(rows, out / "reward_curve.png")
        (out / "validation.md").write_text(validation_table(rows), encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"error: cannot write into {str(out)!r} ({e.strerror or e})") from None
    print(f"wrote {out / 'reward_curve.png'} and {out / 'validation.md'}")


if __name__ == "__main__":
    main()
