"""Side-by-side benchmark of the packed V4.1 layout against nemo_automodel 0.7.0.

Run: ``.venv/bin/python benchmarks/packing.py [--device cuda] [--repeats 7]``

Cases (issue 2):
  (a) 8 rows x 32,768 tokens, 1,024 short documents per row, alignment 4: build the layout.
  (b) 8 rows x 131,072 tokens, 256 documents per row, alignment 128: build the layout.
  (c) pack + restore of a float tensor [8, 131072, 64] on layout (b).
  Peak memory of one ``pack`` of (c)'s tensor, above the live inputs.
  The memcpy floor of (b): one clone of the layout's output tensors (goal: (b) within 3x of it).

Prints one table with median wall times and the upstream/plugin ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from nemo_automodel.components.models.deepseek_v41 import packing as upstream

from nemo_automodel_ext.models.deepseek_v41 import packing as plugin


def random_lengths(batch: int, sequence: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """Document lengths [batch, documents], each row a random composition of ``sequence``."""
    cuts = torch.stack(
        [torch.randperm(sequence - 1, generator=generator)[: documents - 1].sort().values + 1 for _ in range(batch)]
    )
    edges = torch.cat([torch.zeros(batch, 1, dtype=torch.long), cuts, torch.full((batch, 1), sequence)], 1)
    return edges.diff(dim=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_bytes(fn: Callable[[], torch.Tensor], device: torch.device) -> int:
    """Peak memory allocated while ``fn`` runs, above what was live before it (output included)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        # Large CPU tensors are mmap-backed, so resident memory follows live tensors; clear_refs
        # resets the high-water mark (Linux).
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = _proc_status("VmRSS")
        result = fn()
        peak = _proc_status("VmHWM") - before
    del result
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)

    def layouts(batch, sequence, documents, alignment):
        seq_lens = random_lengths(batch, sequence, documents, generator).to(device)
        kwargs = dict(seq_lens_padded=None, input_shape=(batch, sequence), alignment=alignment, minimum_length=sequence)
        return (lambda: upstream.packed_layout(seq_lens, **kwargs)), (lambda: plugin.packed_layout(seq_lens, **kwargs))

    rows = []
    for name, shape in (
        ("(a) layout 8x32768, 1024 docs/row, align 4", (8, 32768, 1024, 4)),
        ("(b) layout 8x131072, 256 docs/row, align 128", (8, 131072, 256, 128)),
    ):
        build_upstream, build_plugin = layouts(*shape)
        rows.append(
            (
                name,
                median_seconds(build_upstream, device, max(3, args.repeats // 2)),
                median_seconds(build_plugin, device, args.repeats),
                "ms",
            )
        )
    layout_upstream, layout_plugin = build_upstream(), build_plugin()
    # The floor of any layout builder: writing its output bytes once (a same-run memcpy of the
    # layout's four tensors).
    outputs = [
        getattr(layout_plugin, name) for name in ("source_indices", "input_positions", "position_ids", "sequence_ids")
    ]
    floor = median_seconds(lambda: [tensor.clone() for tensor in outputs], device, args.repeats)
    layout_mib = sum(tensor.numel() * tensor.element_size() for tensor in outputs) / 2**20
    values = torch.randn(8, 131072, 64, generator=generator).to(device)
    rows.append(
        (
            "(c) pack+restore [8,131072,64] fp32 on (b)",
            median_seconds(lambda: layout_upstream.restore(layout_upstream.pack(values)), device, args.repeats),
            median_seconds(lambda: layout_plugin.restore(layout_plugin.pack(values)), device, args.repeats),
            "ms",
        )
    )
    packed_shape = (*layout_plugin.source_indices.shape, values.shape[-1])
    output_mib = torch.Size(packed_shape).numel() * values.element_size() / 2**20
    rows.append(
        (
            f"peak memory of pack (output {output_mib:.0f} MiB)",
            peak_bytes(lambda: layout_upstream.pack(values), device) / 2**20,
            peak_bytes(lambda: layout_plugin.pack(values), device) / 2**20,
            "MiB",
        )
    )

    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} repeats={args.repeats}")
    print(
        f"(b) memcpy floor of the layout's {layout_mib:.0f} MiB output: {floor * 1e3:.2f} ms; "
        f"plugin layout (b) = {rows[1][2] / floor:.2f}x the floor (goal <= 3x), "
        f"upstream/plugin {rows[1][1] / rows[1][2]:.2f}x (goal >= 1.5x)"
    )
    header = f"{'case':<46} {'upstream':>12} {'plugin':>12} {'upstream/plugin':>16}"
    print(header)
    print("-" * len(header))
    for name, reference, ours, unit in rows:
        scale = 1e3 if unit == "ms" else 1.0
        print(f"{name:<46} {reference * scale:>9.2f} {unit:<3}{ours * scale:>9.2f} {unit:<3}{reference / ours:>15.2f}x")


if __name__ == "__main__":
    main()
