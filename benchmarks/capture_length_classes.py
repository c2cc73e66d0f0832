"""The packed capture on a CPU target: the packed rows as given against the same documents in length-class rows.

Run: ``.venv/bin/python benchmarks/capture_length_classes.py [--micro-batches 12] [--mixes demo skewed longtail]``

On a dense-attention fallback (eager or SDPA, what a CPU target runs) a token's cost grows with its row's
width (``benchmarks/target_row_width.py``), so ``DeepseekV41DSparkTargetModel`` runs a packed batch's
documents in rows of their length class (``models/deepseek_v41/length_classes.py``). Each mix's document
lengths are sampled (lognormal, seeded, clipped; the shapes of ``packing_value.py``'s mixes), packed greedily
into its rows as the recipe packs them (``batching_at_scale.pack_rows``, upstream's greedy packing; a row's
leftover is a padding document), and captured by the demo target, ``--micro-batches`` micro-batches of
``rows`` rows, with ``length_classes="never"`` (the packed rows) and ``"always"`` (the classes). Prints
milliseconds a micro-batch (best of ``--repeats`` passes), the measured speed-up beside the one
``length_classes.dense_forward_seconds`` models (the model ``"auto"`` decides by, on each micro-batch), the share
of micro-batches ``"auto"`` relays, the forwards a micro-batch, and the share of tokens whose captures differ by
more than 1e-4: the same features up to fp32 rounding, which the indexer's FP4 rounding and top-k can turn into
another selection on a near-tie.

The mixes include rows of 256 and 512 filled with the demo's short documents, where relaying pays most.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching_at_scale import ScaleMix, pack_rows, sample_lengths  # noqa: E402

from nemo_automodel_ext.demo.demo_target import load_demo_target  # noqa: E402
from nemo_automodel_ext.models.deepseek_v41.length_classes import (  # noqa: E402
    dense_forward_seconds,
    length_class_rows,
    relaying_pays,
)
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel  # noqa: E402


@dataclass(frozen=True)
class CaptureMix:
    """Lengths to sample and the packed micro-batch they fill: ``rows`` rows of ``row`` tokens."""

    lengths: ScaleMix
    row: int
    rows: int


DEMO_LENGTHS = ScaleMix("demo", 26, 0.35, 12, 44, 4000)
MIXES = {  # packing_value.py's rows and token budgets, then the demo's documents in wider rows
    "demo": CaptureMix(DEMO_LENGTHS, row=128, rows=8),
    "skewed": CaptureMix(ScaleMix("skewed", 64, 0.8, 18, 312, 4000), row=512, rows=2),
    "longtail": CaptureMix(ScaleMix("long-tailed", 200, 1.0, 16, 2048, 4000), row=2048, rows=1),
    "demo-256": CaptureMix(DEMO_LENGTHS, row=256, rows=4),
    "demo-512": CaptureMix(DEMO_LENGTHS, row=512, rows=2),
}


def micro_batches(mix: CaptureMix, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` packed micro-batches: input_ids [rows, row] and seq_lens [rows, documents + 1]."""
    rows = pack_rows(sample_lengths(mix.lengths), mix.row)[: count * mix.rows]
    generator = torch.Generator().manual_seed(0)
    batches = []
    for first in range(0, len(rows) - mix.rows + 1, mix.rows):
        chunk = rows[first : first + mix.rows]
        seq_lens = torch.zeros(mix.rows, max(map(len, chunk)) + 1, dtype=torch.long)
        for index, documents in enumerate(chunk):
            seq_lens[index, : len(documents)] = torch.tensor(documents)
            seq_lens[index, -1] = mix.row - sum(documents)
        batches.append((torch.randint(10, 300, (mix.rows, mix.row), generator=generator), seq_lens))
    return batches


def timed(wrapper: DeepseekV41DSparkTargetModel, batches, repeats: int) -> tuple[float, list]:
    """Best seconds a micro-batch over ``repeats`` passes, and the last pass's captures."""
    best, captures = float("inf"), []
    for _ in range(repeats):
        started, captures = time.perf_counter(), []
        for input_ids, seq_lens in batches:
            ones = torch.ones_like(input_ids)
            captures.append(wrapper.generate_batch(input_ids, ones, ones, seq_lens=seq_lens))
        best = min(best, (time.perf_counter() - started) / len(batches))
    return best, captures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=12)
    parser.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = load_demo_target()
    layers = model.config.text_config.dspark_target_layer_ids
    before = DeepseekV41DSparkTargetModel(model, layers, length_classes="never")
    after = DeepseekV41DSparkTargetModel(model, layers, length_classes="always")
    print(f"demo target, {torch.get_num_threads()} threads, {args.micro_batches} micro-batches a mix")
    print(
        "| mix | micro-batch | packed rows ms | length classes ms | speed-up | modelled | auto relays "
        "| forwards | tokens off by > 1e-4 |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.mixes:
        mix = MIXES[name]
        batches = micro_batches(mix, args.micro_batches)
        timed(after, batches[:1], 1)  # warm-up
        packed, reference = timed(before, batches, args.repeats)
        classes, captured = timed(after, batches, args.repeats)
        laid_out = [length_class_rows(seq_lens, mix.row) for _, seq_lens in batches]
        modelled = (len(batches) * dense_forward_seconds(mix.rows, mix.row)) / sum(
            dense_forward_seconds(*rows.source.shape) for relaid in laid_out for rows in relaid
        )
        relays = sum(relaying_pays(relaid, mix.rows, mix.row) for relaid in laid_out) / len(batches)
        forwards = sum(map(len, laid_out)) / len(batches)
        differing = sum(
            ((ours.target_hidden_states - theirs.target_hidden_states).abs().amax(-1) > 1e-4).sum().item()
            for ours, theirs in zip(captured, reference)
        ) / (len(batches) * mix.rows * mix.row)
        print(
            f"| {name} | {mix.rows} x {mix.row} | {packed * 1e3:.0f} | {classes * 1e3:.0f} | {packed / classes:.2f}x "
            f"| {modelled:.2f}x | {relays:.0%} | {forwards:.1f} | {differing:.2%} |"
        )


if __name__ == "__main__":
    main()
