"""Does ``make compare``'s probe time a baseline's steps as its runs do? Seconds a step of three short runs.

Run: ``.venv/bin/python benchmarks/probe_fidelity.py [--mix demo] [--batching grouped]`` (about 4 minutes on the
demo mix). ``packing_value`` gives each baseline the optimizer steps that fit packed's training seconds, at the
seconds a step its probe measured; its runs then train longer than the budget (docs/packing.md). This runs, one
after another on one core with one thread (``packing_value.train``):

- ``probe``: the probe as ``packing_value`` runs it (a quarter of the data, one epoch, no evaluation, no
  checkpoint, every step logged);
- ``run settings, quarter``: the same quarter and steps with a run's settings (test evaluations, checkpoints, the
  recipe's log interval);
- ``run settings, whole data, one epoch``: a run's settings on the whole data (four times the probe's steps).

Seconds a step are ``packing_value.summarise``'s (past the first logged step, evaluations left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import packing_value  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", default="demo", choices=sorted(packing_value.MIXES))
    parser.add_argument("--batching", default="grouped", choices=[b for b in packing_value.BATCHINGS if b != "packed"])
    parser.add_argument("--lr", type=float, default=5e-3)
    options = parser.parse_args()
    cores = packing_value.Cores(1)
    protocol = packing_value.Protocol(options.mix, False, cores, pool=None)  # the mix's data and shapes, as compare's
    job = dataclasses.replace(protocol.job(options.batching, options.lr, 42, 1, probe=True), tag="fidelity_")
    probe = packing_value.train(job, cores)
    data = protocol.data
    quarter = dict(data, train=job.output / "probe.jsonl")  # the probe's own quarter
    rows = [("probe", probe)]
    for name, each in (("run settings, quarter", quarter), ("run settings, whole data, one epoch", data)):
        run = dataclasses.replace(job, data=each, probe=False, tag=f"fidelity_{len(rows)}_")
        rows.append((name, packing_value.train(run, cores)))
    print(f"\n{options.mix} / {options.batching}, lr {options.lr:g}, one core, one thread, one run at a time\n")
    print("| run | steps | s a step | vs probe |\n| --- | ---: | ---: | ---: |")
    for name, result in rows:
        ratio = result["step_s"] / probe["step_s"]
        print(f"| {name} | {result['step']} | {result['step_s']:.3f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
