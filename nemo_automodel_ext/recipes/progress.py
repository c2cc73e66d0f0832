"""Per-step progress for DSpark runs: a log line with tokens/s and ETA, and ``metrics.jsonl``.

``ProgressMetricLogger`` stands in for the recipe's metric logger: upstream's training loop
hands it one ``MetricsSample`` per logged step (rank 0 only) and it writes one JSON object
per step (``step``, ``epoch``, ``loss``, ``tokens``, ``tokens_per_s``, ``eta_s``, the recipe's
running counters and every loss term) to ``metrics.jsonl``, keeps upstream's own ``dspark_train_metrics.jsonl``, and
logs ``step N/T | loss | tokens/s | ETA``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("nemo_automodel_ext.progress")


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` for a non-negative number of seconds, ``?`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressMetricLogger:
    """Metric logger that adds token throughput and an ETA to each logged step.

    Args:
        path: ``metrics.jsonl`` to append to (created with its folder).
        total_steps: Optimizer steps of the whole run, for the ETA.
        counters: Zero-argument callable returning running counters of the run, at least
            ``tokens`` (real tokens trained on, all data-parallel ranks); all are recorded.
        inner: Optional upstream metric logger that also receives every sample.
        start_step: Step the run (re)starts from; throughput counts from here. Records of
            later steps already in ``path`` (written after the checkpoint a run resumes from)
            are dropped, so the file stays one record per step.
    """

    def __init__(self, path: str | Path, total_steps: int, counters, inner=None, start_step: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", buffering=1)
        self.total_steps = int(total_steps)
        self.counters = counters
        self.inner = inner
        self._start = time.perf_counter()
        self._start_step = int(start_step)
        self._last_time, self._last_tokens = self._start, counters()["tokens"]

    def log(self, sample: Any) -> None:
        """Record one ``MetricsSample`` (``step``, ``epoch``, ``metrics``)."""
        if self.inner is not None:
            self.inner.log(sample)
        now, counters = time.perf_counter(), self.counters()
        tokens = counters["tokens"]
        window_s = max(now - self._last_time, 1e-9)
        tokens_per_s = (tokens - self._last_tokens) / window_s
        done = sample.step - self._start_step
        eta = (now - self._start) / done * (self.total_steps - sample.step) if done > 0 else float("nan")
        self._last_time, self._last_tokens = now, tokens
        record = {"step": int(sample.step), "epoch": int(sample.epoch), **{k: int(v) for k, v in counters.items()}}
        record.update({key: float(value) for key, value in sample.metrics.items() if _is_number(value)})
        record.update({"tokens_per_s": tokens_per_s, "eta_s": eta if math.isfinite(eta) else None})
        self._file.write(json.dumps(record) + "\n")
        logger.info(
            "step %d/%d | epoch %d | loss %.4f | ce %.4f | tv %.4f | %.0f tokens/s | tokens %d | ETA %s",
            sample.step,
            self.total_steps,
            sample.epoch,
            record.get("loss", float("nan")),
            record.get("ce_loss", float("nan")),
            record.get("l1_loss", float("nan")),
            tokens_per_s,
            tokens,
            format_eta(eta),
        )

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self._file.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["ProgressMetricLogger", "format_eta"]
