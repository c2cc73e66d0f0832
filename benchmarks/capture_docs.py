"""Packed V4.1 capture cost against the number of documents in a row: upstream's selection vs the plugin's.

Run: ``.venv/bin/python benchmarks/capture_docs.py [--rows 2048 8192] [--documents 1 8 64 512] [--configs tiny mid]``

One frozen target forward (``prepare_packed_inputs`` + the model, what ``dspark_packed_forward``
runs) on one row of ``--rows`` tokens split into ``--documents`` equal documents, with:

- **upstream**: nemo_automodel 0.7.0's ``_Indexer._select_packed`` (a Python loop over every
  document of every row in each indexer layer: ``unique().tolist()``, two ``torch.where`` and a
  top-k per document);
- **plugin**: ``models/deepseek_v41/selection.py`` (vectorised over documents, installed on the
  target by ``install_packed_indexer``).

Per capture: seconds per 1k tokens (best of ``--repeats``), host reads (ops whose result the host
must read: ``.item()``/``.tolist()``, ``nonzero``, ``unique``, boolean indexing; counted by
dispatch, ``host_syncs.py``), of which in the indexer selection, and ops dispatched (on a GPU, at
least one kernel launch each). Goals (issue 18): host reads and ops per capture independent of the
document count; cost per token at 512 documents within 1.2x of 1 document.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_syncs import count_host_syncs  # noqa: E402
from training_step import MID  # noqa: E402


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def capture(model, tokens: torch.Tensor, seq_lens: torch.Tensor) -> None:
    from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs

    _, inputs = prepare_packed_inputs(model, tokens, seq_lens)
    with torch.no_grad():
        model(**inputs, logits_to_keep=1)


def equal_documents(row: int, documents: int) -> torch.Tensor:
    lengths = [row // documents] * documents
    lengths[-1] += row - sum(lengths)
    return torch.tensor([lengths])


def measure(model, row: int, documents: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(row + documents)
    tokens = torch.randint(10, model.config.text_config.vocab_size - 10, (1, row), generator=generator)
    seq_lens = equal_documents(row, documents)
    capture(model, tokens, seq_lens)  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        capture(model, tokens, seq_lens)
        seconds.append(time.perf_counter() - started)
    counter = _CountOps()
    with count_host_syncs() as sites, counter:
        capture(model, tokens, seq_lens)
    return {
        "ms_per_ktok": 1000 * min(seconds) / (row / 1000),
        "host_reads": sum(sites.values()),
        "selection_reads": selection_reads(model, tokens, seq_lens),
        "ops": counter.ops,
    }


def selection_reads(model, tokens: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """Host reads of the indexer selection alone: every layer's call recorded, then re-run under the counter."""
    calls = []
    indexers = [module for module in model.modules() if hasattr(module, "_select_packed")]
    for indexer in indexers:
        select = indexer._select_packed

        def record(*args, select=select):
            calls.append((select, args))
            return select(*args)

        indexer._select_packed = record  # an instance attribute, removed below
    try:
        capture(model, tokens, seq_lens)
    finally:
        for indexer in indexers:
            del indexer._select_packed
    with count_host_syncs() as sites:
        for select, args in calls:
            select(*args)
    return sum(sites.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048])
    parser.add_argument("--documents", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--configs", nargs="+", default=["tiny", "mid"], choices=["tiny", "mid"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer
    from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, tiny_target_config

    print(f"torch threads: {torch.get_num_threads()}")
    header = (
        f"{'config':6} {'row':>6} {'docs':>5} | {'upstream ms/1k tok':>18} {'reads':>6} {'(select)':>8} {'ops':>7}"
        f" | {'plugin ms/1k tok':>16} {'reads':>6} {'(select)':>8} {'ops':>7} | {'time x':>6}"
    )
    print(header)
    print("-" * len(header))
    for name in args.configs:
        config = tiny_target_config(**(MID if name == "mid" else {}))
        upstream = build_tiny_target(config=config, packed_indexer=False)
        plugin = copy.deepcopy(upstream)
        install_packed_indexer(plugin)
        for row in args.rows:
            baseline: dict[str, dict] = {}
            for documents in args.documents:
                if row // documents < 1:
                    continue
                results = {
                    "upstream": measure(upstream, row, documents, args.repeats),
                    "plugin": measure(plugin, row, documents, args.repeats),
                }
                for impl in results:
                    baseline.setdefault(impl, results[impl])
                up, ours = results["upstream"], results["plugin"]
                print(
                    f"{name:6} {row:>6} {documents:>5} | {up['ms_per_ktok']:>18.1f} {up['host_reads']:>6} "
                    f"{up['selection_reads']:>8} {up['ops']:>7} | {ours['ms_per_ktok']:>16.1f} "
                    f"{ours['host_reads']:>6} {ours['selection_reads']:>8} {ours['ops']:>7} | "
                    f"{up['ms_per_ktok'] / ours['ms_per_ktok']:>6.2f}",
                    flush=True,
                )
            for impl, first in baseline.items():
                last = results[impl]
                print(
                    f"  {name} {row}: {impl} at {args.documents[-1]} documents / 1 document: "
                    f"time {last['ms_per_ktok'] / first['ms_per_ktok']:.2f}x, host reads "
                    f"{first['host_reads']} -> {last['host_reads']}, ops {first['ops']} -> {last['ops']}"
                )


if __name__ == "__main__":
    main()
