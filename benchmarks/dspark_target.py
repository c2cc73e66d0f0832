"""Packed DSpark capture on a V4.1 target: overhead and real-token throughput, in one table.

Run: ``.venv/bin/python benchmarks/dspark_target.py [--rows 4 --sequence 512 --repeats 9]``

1. Overhead: median time of ``dspark_packed_forward`` (layout + pack + frozen forward) against the
   bare model forward on the same, already aligned tokens (goal: at most 5% overhead), timed
   alternately; and the added work (validation, layout, pack) timed alone, since on a noisy CPU
   the difference of two forwards is within their jitter.
2. Throughput: real tokens/s of packed capture (``DeepseekV41DSparkTargetModel`` on packed rows)
   against upstream's way without packing: every document its own row, right-padded to the
   longest document, on a length-skewed batch (goal: at least 2x).

The model is the shipped tiny V4.1 target (CPU, eager attention) unless ``--hidden`` enlarges it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nemo_automodel_ext.models.deepseek_v41.dspark_target import (
    aligned_packed_layout,
    compression_alignment,
    dspark_packed_forward,
    prepare_packed_inputs,
)
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, cpu_backend, tiny_target_config


def paired_medians(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of two callables timed alternately, so machine noise hits both alike."""
    first(), second()
    times = ([], [])
    for _ in range(repeats):
        for fn, bucket in zip((first, second), times):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def skewed_lengths(rows: int, sequence: int, generator: torch.Generator) -> torch.Tensor:
    """Per row: one long document (~60% of the row) and short ones (8..32 tokens) filling the rest."""
    table = []
    for _ in range(rows):
        long = int(sequence * 0.6)
        row = [long]
        left = sequence - long
        while left > 0:
            length = min(left, int(torch.randint(8, 33, (1,), generator=generator)))
            row.append(length)
            left -= length
        table.append(row)
    width = max(map(len, table))
    return torch.tensor([row + [0] * (width - len(row)) for row in table])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--hidden", type=int, default=None, help="hidden size override (multiple of 16)")
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    overrides = {} if args.hidden is None else {"hidden_size": args.hidden}
    model = build_tiny_target(config=tiny_target_config(**overrides), backend=cpu_backend())
    layer_ids = model.config.text_config.dspark_target_layer_ids
    wrapper = DeepseekV41DSparkTargetModel(model, layer_ids)
    vocab = model.config.text_config.vocab_size

    seq_lens = skewed_lengths(args.rows, args.sequence, generator)
    input_ids = torch.randint(4, vocab - 1, (args.rows, args.sequence), generator=generator)
    real_tokens = int(seq_lens.clamp_min(0).sum())

    # 1. Overhead against the bare forward on identical aligned tokens.
    layout = aligned_packed_layout(seq_lens, tuple(input_ids.shape), compression_alignment(model), False)
    packed_ids = layout.pack(input_ids, fill=model.config.text_config.pad_token_id)
    mask, positions, sequence_ids = layout.sequence_ids > 0, layout.position_ids, layout.sequence_ids

    def bare() -> None:
        with torch.no_grad():
            model(
                packed_ids, attention_mask=mask, position_ids=positions, packed_seq_ids=sequence_ids, logits_to_keep=1
            )

    bare_s, packed_s = paired_medians(bare, lambda: dspark_packed_forward(model, input_ids, seq_lens), args.repeats)
    # The overhead itself, timed alone: validation, layout and pack (the forward is identical).
    prepare_s, _ = paired_medians(lambda: prepare_packed_inputs(model, input_ids, seq_lens), lambda: None, 50)

    # 2. Real-token throughput: packed capture against one padded row per document.
    ones = torch.ones_like(input_ids)
    documents = []
    for row, lengths in enumerate(seq_lens.tolist()):
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
        documents.extend((row, start, length) for start, length in zip(starts, lengths) if length > 0)
    longest = max(length for _, _, length in documents)
    padded_ids = torch.full((len(documents), longest), model.config.text_config.pad_token_id, dtype=torch.long)
    padded_mask = torch.zeros_like(padded_ids)
    for index, (row, start, length) in enumerate(documents):
        padded_ids[index, :length] = input_ids[row, start : start + length]
        padded_mask[index, :length] = 1
    capture_padded_s, capture_packed_s = paired_medians(
        lambda: wrapper.generate_batch(padded_ids, padded_mask, padded_mask),
        lambda: wrapper.generate_batch(input_ids, ones, ones, seq_lens=seq_lens),
        args.repeats,
    )

    print(
        f"model hidden={model.config.text_config.hidden_size} layers={model.config.text_config.num_hidden_layers} "
        f"alignment={compression_alignment(model)} rows={args.rows} sequence={args.sequence} "
        f"documents={len(documents)} real_tokens={real_tokens} aligned_width={layout.source_indices.shape[1]} "
        f"padded_batch={tuple(padded_ids.shape)} threads={torch.get_num_threads()}"
    )
    header = f"{'measure':<58} {'reference':>14} {'plugin':>14} {'ratio':>10}"
    print(header)
    print("-" * len(header))
    print(
        f"{'time: bare forward vs dspark_packed_forward (ms)':<58} {bare_s * 1e3:>14.2f} {packed_s * 1e3:>14.2f} "
        f"{'overhead ' + format((packed_s / bare_s - 1) * 100, '+.1f') + '%':>10}"
    )
    print(
        f"{'  of which validation + layout + pack alone (ms)':<58} {'':>14} {prepare_s * 1e3:>14.2f} "
        f"{format(prepare_s / bare_s * 100, '.1f') + '%':>10}"
    )
    print(
        f"{'real tokens/s: pad-to-longest vs packed capture':<58} {real_tokens / capture_padded_s:>14.0f} "
        f"{real_tokens / capture_packed_s:>14.0f} {capture_padded_s / capture_packed_s:>9.2f}x"
    )


if __name__ == "__main__":
    main()
