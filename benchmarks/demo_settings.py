"""The demo recipe's learning rate and epochs, chosen on the dev split (never on the test prompts).

Run: ``.venv/bin/python benchmarks/demo_settings.py [--lrs 5e-3 1e-2 1.5e-2 2e-2] [--epochs 10 12]``

Trains ``recipes/deepseek_v41/dspark_tiny_cpu.yaml`` (packed, the demo mix) at every learning rate and epoch
count given, ``make compare``'s way (one core and one thread a run, ``--jobs`` at once; ``packing_value.train``),
scores each final draft with the exact greedy evaluator on ``dev.jsonl`` and prints the grid; the recipe takes the
best. Test taus are in each run's ``metrics.jsonl`` but play no part in the choice. Writes
``outputs/compare/demo_settings.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import packing_value  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-3, 1e-2, 1.5e-2, 2e-2])
    parser.add_argument("--epochs", type=int, nargs="+", default=[10])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    options = parser.parse_args()
    mix = packing_value.MIXES["demo"]
    data = packing_value.mix_data("demo")
    counted = packing_value.lengths(data["train"])
    shape = packing_value.shape("packed", mix, counted, 48)
    cores = packing_value.Cores(max(1, options.jobs))
    jobs = [
        packing_value.Job("demo", "packed", lr, options.seed, epochs, shape, data, tag=f"settings_{epochs}epochs_")
        for epochs in options.epochs
        for lr in options.lrs
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        runs = list(pool.map(lambda job: packing_value.train(job, cores), jobs))
    print("\n| epochs | " + " | ".join(f"lr {lr:g}" for lr in options.lrs) + " |")
    print("| ---: |" + " ---: |" * len(options.lrs))
    for epochs in options.epochs:
        scores = [run["dev_tau"] for run in runs if run["epochs"] == epochs]
        print(f"| {epochs} | " + " | ".join(f"{score:.3f}" for score in scores) + " |")
    best = max(runs, key=lambda run: run["dev_tau"])
    print(f"\nbest on dev: lr {best['lr']:g}, {best['epochs']} epochs (dev greedy tau {best['dev_tau']:.3f})")
    saved = packing_value.OUT / "demo_settings.json"
    saved.write_text(json.dumps({"runs": runs, "best": {"lr": best["lr"], "epochs": best["epochs"]}}, indent=1) + "\n")
    print(f"results: {saved}")


if __name__ == "__main__":
    main()
