"""The device kit runs end to end on CPU, and its wheel list is the one docs/testing.md states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402


def test_wheel_list_is_the_documented_one():
    assert gpu_wheels.documented() == [requirement for requirement, _ in gpu_wheels.WHEELS]
    gpu_wheels.check_documented()


def test_a_drifted_wheel_list_is_refused(monkeypatch):
    monkeypatch.setattr(gpu_wheels, "WHEELS", gpu_wheels.WHEELS[:-1])
    with pytest.raises(ValueError, match="gpu-wheels block lists"):
        gpu_wheels.check_documented()


def test_gpu_check_runs_every_section_on_cpu(tmp_path, flash_widths_alone):
    """``--device cpu --quick``: every section measured (none failed), the JSON and markdown written."""
    output = tmp_path / "check"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--device", "cpu", "--quick", "--output", str(output)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((output / "gpu_check.json").read_text())
    assert set(record["sections"]) == {"memory", "draft_flops", "recipe", "capture"}
    assert not [name for name, section in record["sections"].items() if "error" in section or "skipped" in section]
    memory = record["sections"]["memory"]["rows"]
    # The GPU run re-measures two points of every fitted slope: capture in tokens; the draft step in anchors and in
    # tokens. --quick measures its small points (one draft step: about 30 s on CPU at Flash widths).
    assert len(gpu_check.MEMORY_TOKENS) >= 3  # the capture's fit is quadratic
    assert len({a for a, _ in gpu_check.MEMORY_STEPS}) >= 2 and len({t for _, t in gpu_check.MEMORY_STEPS}) >= 2
    assert [row["tokens"] for row in memory if row["phase"] == "capture"] == list(gpu_check.QUICK_TOKENS)
    steps = [(row["anchors"], row["tokens"]) for row in memory if row["phase"] == "draft_step"]
    assert steps == list(gpu_check.QUICK_STEPS)
    assert len([row for row in memory if row["phase"] == "one MoE block"]) == 2  # the bytes a routed pair
    assert len([row for row in memory if row["phase"] == "one Engram block"]) == 2
    # On CPU the counter is the calibration's own: the fit must hold at the re-measured points.
    assert all(0.9 < row["ratio"] < 1.1 for row in memory), memory
    assert record["sections"]["draft_flops"]["rows"][0]["flops"] > 0
    recipe = record["sections"]["recipe"]
    assert recipe["steps"] >= 1 and 1.0 <= recipe["greedy_tau"] <= 5.0
    assert {row["impl"] for row in record["sections"]["capture"]["capture"]} == {"upstream", "plugin"}
    text = (output / "gpu_check.md").read_text()
    assert "(c) Memory" in text and "(d) Draft step" in text and "(a) Tiny recipe" in text


def test_gpu_check_refuses_unknown_sections_and_a_file_output(tmp_path):
    script = str(REPO / "benchmarks/gpu_check.py")
    result = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--sections", "memroy"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--sections: unknown memroy" in result.stderr
    (tmp_path / "f").write_text("")
    result = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--output", str(tmp_path / "f")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "is a file" in result.stderr
