"""Per-step progress for DSpark runs: a log line with tokens/s and ETA, and ``metrics.jsonl``.

``ProgressMetricLogger`` stands in for the recipe's metric logger: upstream's training loop
hands it one ``MetricsSample`` per logged step (rank 0 only) and it writes one JSON object
per step (``step``, ``epoch``, ``loss``, ``tokens``, ``tokens_per_s``, ``eta_s``, ``train_s``: seconds
since this process started training, evaluations excluded; the recipe's running counters and every loss
term) to ``metrics.jsonl``, keeps upstream's own ``dspark_train_metrics.jsonl``, and
logs ``step N/T | loss | ... | tokens/s | ETA``: the run's one line per logged step
(``quiet_upstream_step_lines`` drops upstream's duplicate line, the recipe drops its tqdm bar).
Validation results (``log_eval``) are records with ``"split": "val"``, the counters and ``train_s`` of that point.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

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
            kept = [line for line in self.path.read_text().splitlines() if _record_step(line) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", buffering=1)
        self.total_steps = int(total_steps)
        self.counters = counters
        self.inner = inner
        self._start = time.perf_counter()
        self._excluded = 0.0
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
        record["train_s"] = now - self._start - self._excluded
        self._file.write(json.dumps(record) + "\n")
        logger.info(
            "step %d/%d | epoch %d | loss %.4f | ce %.4f | tv %.4f | accept %.3f | tau %.2f | lr %.2e | "
            "%.0f tokens/s | tokens %d | ETA %s",
            sample.step,
            self.total_steps,
            sample.epoch,
            record.get("loss", float("nan")),
            record.get("ce_loss", float("nan")),
            record.get("l1_loss", float("nan")),
            record.get("accept_rate", float("nan")),
            record.get("tau", float("nan")),
            record.get("lr", float("nan")),
            tokens_per_s,
            tokens,
            format_eta(eta),
        )

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation) out of ``train_s``: seconds of this process spent training."""
        self._excluded += seconds

    def log_eval(self, step: int, epoch: int, metrics: dict[str, Any]) -> None:
        """Record validation metrics at ``step`` as one ``"split": "val"`` record, with the run's counters and
        ``train_s`` at that point (a curve of tau against training time or tokens needs no step record)."""
        record = {"step": int(step), "epoch": int(epoch), "split": "val"}
        record.update({key: int(value) for key, value in self.counters().items()})
        record["train_s"] = time.perf_counter() - self._start - self._excluded
        record.update({key: float(value) for key, value in metrics.items() if _is_number(value)})
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self._file.close()


class TrailingWindow:
    """Training metrics of the micro-batches since the last logged step, summed on the device.

    Upstream's loop logs only steps that complete a full ``grad_accumulation_steps`` window; the
    step that flushes an epoch's partial window is trained but never logged (and with fewer
    batches than ``grad_accumulation_steps``, no step is). The recipe logs those steps from this
    window. Sums stay tensors (no host read per micro-batch) in the layout of upstream's
    ``_DSparkMetricWindow.pack()``, whose ``unpack`` turns them into the logged averages.
    """

    def __init__(self, block_size: int, device) -> None:
        from nemo_automodel.recipes.llm.train_dspark import _DSPARK_WINDOW_SCALARS, _DSparkMetricWindow

        self._names = _DSPARK_WINDOW_SCALARS
        self._window = _DSparkMetricWindow(block_size=block_size, device=device)
        self.sums = None

    def reset(self) -> None:
        self.sums = None

    def add(self, metrics) -> None:
        """Accumulate one micro-batch's ``DSparkStepMetrics``."""
        one = metrics.loss.detach().new_ones(())
        scalars = [one if name == "num_micro_batches" else getattr(metrics, name).detach() for name in self._names]
        packed = torch.cat(
            [
                torch.stack([value.float().reshape(()) for value in scalars]),
                metrics.accept_rate_per_pos_num.detach().float(),
                metrics.accept_rate_per_pos_den.detach().float(),
            ]
        )
        self.sums = packed if self.sums is None else self.sums + packed

    def averages(self, all_reduce) -> dict[str, float]:
        """The window's logged metrics, summed over ranks by ``all_reduce`` (a collective)."""
        return self._window.unpack(all_reduce(self.sums.clone()))


class _UpstreamStepLine(logging.Filter):
    """Drops upstream's per-step ``step N | epoch ...`` line; the plugin's line carries its fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("step %d | epoch %d | loss"))


def quiet_upstream_step_lines() -> None:
    """Keep one progress line per logged step: filter upstream ``train_dspark``'s duplicate (idempotent)."""
    upstream = logging.getLogger("nemo_automodel.recipes.llm.train_dspark")
    if not any(isinstance(existing, _UpstreamStepLine) for existing in upstream.filters):
        upstream.addFilter(_UpstreamStepLine())


def _record_step(line: str) -> float:
    """A metrics.jsonl line's step; a partial line (a kill mid-write) sorts after every step, so it is dropped."""
    try:
        return float(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["ProgressMetricLogger", "TrailingWindow", "format_eta", "quiet_upstream_step_lines"]
