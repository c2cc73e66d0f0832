"""metrics.jsonl and progress lines of DSpark runs."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from nemo_automodel_ext.recipes.progress import ProgressMetricLogger, format_eta


def _sample(step, loss):
    return SimpleNamespace(step=step, epoch=0, metrics={"loss": loss, "ce_loss": 2 * loss, "flag": True})


def test_one_record_per_step_with_tokens_and_eta(tmp_path, caplog):
    counters = {"tokens": 0}
    logger = ProgressMetricLogger(tmp_path / "m" / "metrics.jsonl", 4, lambda: dict(counters))
    with caplog.at_level(logging.INFO, logger="nemo_automodel_ext.progress"):
        for step in (1, 2):
            counters["tokens"] += 100
            logger.log(_sample(step, 1.0 / step))
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens"], r["loss"]) for r in records] == [(1, 100, 1.0), (2, 200, 0.5)]
    assert "flag" not in records[0] and records[1]["tokens_per_s"] > 0 and records[1]["eta_s"] >= 0
    assert "step 2/4" in caplog.text and "tokens/s" in caplog.text and "ETA" in caplog.text


def test_resume_drops_records_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 8)))
    logger = ProgressMetricLogger(path, 10, lambda: {"tokens": 0}, start_step=5)
    logger.log(_sample(6, 0.25))
    logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_format_eta():
    assert format_eta(3725) == "1:02:05"
    assert format_eta(float("nan")) == "?"


def test_resume_survives_a_partial_last_line(tmp_path):
    """A kill mid-write leaves half a record: the resume drops it instead of dying on JSONDecodeError."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 5)) + '{"step": 5, "lo')
    logger = ProgressMetricLogger(path, 10, lambda: {"tokens": 0}, start_step=4)
    logger.log(_sample(5, 0.25))
    logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_validation_records_are_marked_with_counters_and_training_seconds(tmp_path, monkeypatch):
    """A val record carries the run's counters and ``train_s`` (evaluations left out) of its point: a curve of tau
    against training seconds or tokens needs no step record at that step."""
    clock = [100.0]
    monkeypatch.setattr("nemo_automodel_ext.recipes.progress.time.perf_counter", lambda: clock[0])
    logger = ProgressMetricLogger(tmp_path / "metrics.jsonl", 10, lambda: {"tokens": 7, "documents": 2})
    clock[0] = 103.0
    logger.log(_sample(1, 0.5))
    clock[0] = 108.0  # 5 s, of which an evaluation took 4
    logger.exclude(4.0)
    logger.log_eval(1, 0, {"greedy_tau": 2.5, "note": "x"})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["train_s"] == 3.0
    assert records[1] == {
        "step": 1,
        "epoch": 0,
        "split": "val",
        "tokens": 7,
        "documents": 2,
        "train_s": 4.0,
        "greedy_tau": 2.5,
    }
