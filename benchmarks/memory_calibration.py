"""Measure the bytes of every phase of packed DSpark at V4.1-Flash widths on CPU and fit the memory model to them.

Run: ``.venv/bin/python benchmarks/memory_calibration.py [--write]`` (about 8 minutes on 2 cores, 14 GB of
memory; nothing is downloaded).

What is measured and how is in ``nemo_automodel_ext/planning/calibration.py``: bytes counted at the
dispatcher (``planning/allocations.py``, independent of the machine's speed) while the plugin's capture
runs a 5-layer target with one layer of each V4.1 kind, and the released 3-layer draft runs its forward,
DSpark loss and backward, both at the real Flash widths in bf16 (the draft step also as a timeline of three
windows: forward, loss, layers' backward). Prints each measured point beside the
fit (relative error), the fitted coefficients in readable units, and the model's old formula where it had
one. ``--write`` stores the record as ``nemo_automodel_ext/planning/calibration.json``, which the memory
model and the recipes' refusal read; ``tests/planning/test_calibration.py`` re-measures enough points to pin
every fitted term.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "nemo_automodel_ext" / "planning" / "calibration.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store the record as {TARGET.relative_to(REPO)}")
    options = parser.parse_args()
    from nemo_automodel_ext.quiet import install_quiet_filters

    install_quiet_filters(cpu_only=True)
    from nemo_automodel_ext.planning.calibration import DRAFT_WINDOWS, calibrate

    start = time.perf_counter()
    record = calibrate(log=lambda line: print(f"[{time.perf_counter() - start:5.0f} s] {line}", flush=True))
    coefficients, points = record["coefficients"], record["points"]

    a, b, c = coefficients["capture"]
    print("\n| capture: tokens | measured MiB | fitted MiB | error |\n| ---: | ---: | ---: | ---: |")
    for tokens, measured in points["capture"] + points["capture check"]:
        fitted = a + b * tokens + c * tokens * tokens
        check = " (check, not fitted)" if [tokens, measured] in points["capture check"] else ""
        print(f"| {tokens:.0f}{check} | {measured / 2**20:.1f} | {fitted / 2**20:.1f} | {fitted / measured - 1:+.2%} |")
    a, b, c = coefficients["draft_step"]
    print("\n| draft step: anchors | tokens | measured MiB | fitted MiB | error |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for anchors, tokens, measured in points["draft_step"]:
        fitted = a + b * anchors + c * tokens
        print(
            f"| {anchors:.0f} | {tokens:.0f} | {measured / 2**20:.1f} | {fitted / 2**20:.1f} | "
            f"{fitted / measured - 1:+.2%} |"
        )
    windows = [f"draft {window}" for window in DRAFT_WINDOWS]
    print("\n| draft step timeline: anchors | tokens | " + " | ".join(f"{key[6:]} MiB" for key in windows) + " |")
    print("| ---: | ---: |" + " ---: |" * len(windows))
    for index, (anchors, tokens, _) in enumerate(points["draft_step"]):
        cells = " | ".join(f"{points[key][index][-1] / 2**20:.1f}" for key in windows)
        print(f"| {anchors:.0f} | {tokens:.0f} | {cells} |")
    capture, step = coefficients["capture"], coefficients["draft_step"]
    vocab_copy = 5 * 129280 * 4  # one fp32 [block, vocab] logits copy of an anchor
    print("\n| coefficient | measured | the model's formula before |\n| --- | ---: | ---: |")
    print(f"| capture, per local token | {capture[1] / 1024:.1f} KiB | 294.0 KiB (activations) |")
    print(f"| capture, per local x row token pair | {capture[2]:.2f} B | indexer formula |")
    print(f"| capture, constant | {capture[0] / 2**20:.1f} MiB | 0 |")
    print(f"| captured, per column | {coefficients['captured'][1] / 1024:.1f} KiB | 40.0 KiB |")
    print(f"| one Engram block alone, per token | {coefficients['engram'][1] / 1024:.1f} KiB | not counted |")
    print(
        f"| draft step, per anchor | {step[1] / 2**20:.2f} MiB ({step[1] / vocab_copy:.1f} fp32 logits copies) | "
        f"{3 * vocab_copy / 2**20 + 5 * 2 * 5120 * (3 + 12 + 6) / 2**20:.2f} MiB (3 copies + layer inputs) |"
    )
    print(f"| draft step, per feature column | {step[2] / 1024:.1f} KiB | 0 |")
    print(f"| draft step, constant | {step[0] / 2**20:.1f} MiB | 0 |")
    print(f"| draft gradients, per parameter | {coefficients['draft_gradients'][0]:.2f} B | 2 B |")
    print(f"| AdamW state, per parameter | {coefficients['optimizer_state'][0]:.2f} B | 8 B (fp32 moments) |")
    print(f"| AdamW step transient, per parameter | {coefficients['optimizer_transient'][0]:.2f} B | 0 |")
    print(f"\nmeasured in {time.perf_counter() - start:.0f} s")
    if options.write:
        TARGET.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {TARGET.relative_to(REPO)}")


if __name__ == "__main__":
    main()
