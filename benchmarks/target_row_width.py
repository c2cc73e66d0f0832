"""The demo target's cost a token against the packed row's width, at the same tokens and documents.

Run: ``.venv/bin/python benchmarks/target_row_width.py [--tokens 16384] [--document 128] [--widths 128 256 512 2048]``

One frozen forward of the demo target (``prepare_packed_inputs`` + the model, what ``dspark_packed_forward`` and
``packed_predictions`` run) on ``--tokens`` tokens of ``--document``-token documents, laid out in rows of each
``--width``. The documents are the same at every width; only how many share a row changes. On CPU the target runs
upstream's eager attention, which scores every query against the whole row (a dense [row, row + row / ratio]
matrix a head, masked to the document and window), so its cost a token grows with the row's width although each
query reads only its window and selected blocks. TileLang's sparse path on a GPU reads indices instead
(``attention.py``), so this is a CPU figure: it is why ``packed_predictions`` sizes rows to their members and the
capture runs a packed batch in length classes where that pays (``models/deepseek_v41/length_classes.py``,
``benchmarks/capture_length_classes.py``), and why a CPU comparison at 2,048-token rows charged packing a cost a
GPU run does not pay (docs/packing.md).

Prints tokens a second (best of ``--repeats``), user and system CPU seconds of that forward, and the ratio to the
narrowest width.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from nemo_automodel_ext.demo.demo_target import load_demo_target
from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer


def measure(model, tokens: int, document: int, width: int, repeats: int) -> tuple[float, float, float]:
    """Seconds, user and system CPU seconds of the fastest of ``repeats`` forwards at ``width``."""
    rows = tokens // width
    ids = torch.randint(10, 300, (rows, width), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((rows, width // document), document)
    best = (float("inf"), 0.0, 0.0)
    with torch.no_grad():
        for _ in range(repeats):
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            _, inputs = prepare_packed_inputs(model, ids, lengths)
            model(**inputs)
            seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
            if seconds < best[0]:
                best = (seconds, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--document", type=int, default=128)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for width in args.widths:
        if width % args.document or args.tokens % width:
            raise ValueError(f"--widths: {width} must be a multiple of --document and divide --tokens")
    model = load_demo_target()
    install_packed_indexer(model)
    print(f"demo target, {args.tokens:,} tokens in documents of {args.document}, {torch.get_num_threads()} threads")
    print("| row width | rows | tokens/s | user s | sys s | cost a token vs narrowest |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    first = None
    for width in args.widths:
        seconds, user, system = measure(model, args.tokens, args.document, width, args.repeats)
        first = first or seconds
        print(
            f"| {width:,} | {args.tokens // width} | {args.tokens / seconds:,.0f} | {user:.2f} | {system:.2f} "
            f"| {seconds / first:.1f}x |"
        )


if __name__ == "__main__":
    main()
