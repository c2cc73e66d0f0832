"""``training_curves.png`` of a DSpark run, drawn from its ``metrics.jsonl``.

Four panels against the optimizer step: the training loss, the total-variation (L1) distance
to the target's distribution, the teacher-forced training ``tau``, and the exact greedy
acceptance length of the validation evaluation (``greedy_tau``). The recipe draws it at the end
of a run; ``python -m nemo_automodel_ext.recipes.plots RUN_DIR`` redraws it at any time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PANELS = (
    ("loss", "training loss", None),
    ("l1_loss", "TV distance to the target", None),
    ("tau", "training tau (teacher-forced)", None),
    ("greedy_tau", "eval tau (greedy, exact)", "val"),
)


def read_records(path: str | Path) -> list[dict]:
    """The complete JSON records of a ``metrics.jsonl`` (a partial last line is ignored)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_training_curves(metrics_path: str | Path, output: str | Path | None = None) -> Path:
    """Draw the run's curves; returns the written PNG path (default: beside ``metrics_path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path = Path(metrics_path)
    output = Path(output) if output else metrics_path.with_name("training_curves.png")
    records = read_records(metrics_path)
    figure, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for axis, (key, title, split) in zip(axes, PANELS):
        points = [(r["step"], r[key]) for r in records if r.get("split") == split and r.get(key) is not None]
        if points:
            steps, values = zip(*points)
            axis.plot(steps, values, marker="o" if split else None, markersize=3, linewidth=1.2)
            axis.annotate(f"{values[-1]:.3g}", (steps[-1], values[-1]), textcoords="offset points", xytext=(-10, 6))
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.suptitle(metrics_path.parent.name, fontsize=10)
    figure.tight_layout()
    temporary = output.with_name(output.name + ".tmp.png")
    figure.savefig(temporary, dpi=110)
    plt.close(figure)
    temporary.replace(output)
    return output


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m nemo_automodel_ext.recipes.plots RUN_DIR_OR_METRICS_JSONL", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    print(plot_training_curves(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
