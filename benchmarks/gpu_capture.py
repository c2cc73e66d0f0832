"""The capture and indexer comparisons of issue 18 on a GPU: upstream's packed V4.1 forward vs the plugin's.

Run (on a machine with CUDA, from the repository root, under 5 minutes):
``.venv/bin/python benchmarks/gpu_capture.py``; ``--device cpu --quick`` checks the script itself on CPU.

Prints two tables, each upstream's implementation next to the plugin's on the same inputs:

1. **Capture** (``dspark_packed_forward``'s target forward, ``benchmarks/capture_docs.py`` on the GPU): the
   mid config in BF16, one 8k row of 1, 64 and 512 equal documents: milliseconds per 1k tokens (CUDA events,
   best of 5 after a warm-up), host reads (ops whose result the host must read, counted by dispatch),
   ops dispatched (a kernel launch or more each) and peak allocated memory.
2. **One indexer layer** (``benchmarks/indexer_band.py`` on the GPU): 16k, 64k and 128k rows of 256
   documents, compression ratio 1 (as released Flash's layers 20-39), milliseconds and peak allocated memory;
   the plugin at ``BAND_ELEMENTS`` 2^22 (CPU's default), 2^24 and 2^26 (CUDA's default: fewer, larger calls).

Attention and the indexer use TileLang where it imports (``--attn tilelang``), SDPA/eager otherwise; a case
that runs out of memory prints ``OOM``, one that fails otherwise its error in one line. The tests need
nothing here.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from capture_docs import _CountOps, capture, equal_documents  # noqa: E402
from host_syncs import count_host_syncs  # noqa: E402
from indexer_band import build  # noqa: E402
from training_step import MID  # noqa: E402


def tilelang_available() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:
        return False
    return True


def timed(function, device: str, repeats: int) -> tuple[float, float]:
    """(best milliseconds, peak allocated GiB) of ``function()`` after one warm-up call."""
    function()
    best = float("inf")
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(repeats):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            stop.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(stop))
        else:
            import time

            started = time.perf_counter()
            function()
            best = min(best, 1000 * (time.perf_counter() - started))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else float("nan")
    return best, peak


def guarded(function):
    """``function()``, or the one-line reason it failed (out of memory, a kernel that does not take these shapes)."""
    try:
        return function()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "OOM"
    except Exception as error:  # a benchmark row, not a test: report and go on
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"


def bf16_target(device: str, attn: str):
    """The mid-width tiny target built on ``device`` with upstream's BF16 initialisation (FP32 parameters kept)."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend, tiny_target_config

    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV41ForCausalLM(tiny_target_config(**MID), backend=cpu_backend(attn=attn))
        model.initialize_weights(dtype=torch.bfloat16)
    return model.eval()


def capture_rows(device: str, attn: str, row: int, documents: list[int], repeats: int) -> list[dict]:
    """Table 1's rows: ``{"docs", "impl", "ms_per_1k", "host_reads", "ops", "peak_gib"}`` or ``{"docs", "impl",
    "error"}``, each printed as it is measured."""
    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer

    upstream = bf16_target(device, attn)
    plugin = copy.deepcopy(upstream)
    install_packed_indexer(plugin)
    print(f"\n### Capture: mid config, {row}-token row, attention {attn}, {device}\n")
    print("| docs | impl | ms / 1k tok | host reads | ops | peak GiB |\n| ---: | --- | ---: | ---: | ---: | ---: |")
    vocab = upstream.config.text_config.vocab_size
    rows = []
    for count in documents:
        tokens = torch.randint(10, vocab - 10, (1, row), generator=torch.Generator().manual_seed(count)).to(device)
        seq_lens = equal_documents(row, count).to(device)
        for name, model in (("upstream", upstream), ("plugin", plugin)):
            result = guarded(lambda: timed(lambda: capture(model, tokens, seq_lens), device, repeats))
            if isinstance(result, str):
                rows.append({"docs": count, "impl": name, "error": result})
                print(f"| {count} | {name} | {result} | | | |", flush=True)
                continue
            counter = _CountOps()
            with count_host_syncs() as sites, counter:
                capture(model, tokens, seq_lens)
            milliseconds, peak = result
            rows.append(
                {
                    "docs": count,
                    "impl": name,
                    "ms_per_1k": milliseconds / (row / 1000),
                    "host_reads": sum(sites.values()),
                    "ops": counter.ops,
                    "peak_gib": peak,
                }
            )
            print(
                f"| {count} | {name} | {milliseconds / (row / 1000):.2f} | {sum(sites.values())} | {counter.ops} "
                f"| {peak:.2f} |",
                flush=True,
            )
    return rows


def indexer_rows(device: str, attn: str, rows: list[int], documents: int, repeats: int) -> list[dict]:
    """Table 2's rows: ``{"row", "impl", "ms", "peak_gib"}`` or ``{"row", "impl", "error"}``, printed as measured."""
    from nemo_automodel_ext.models.deepseek_v41 import packed_indexer

    print(f"\n### One indexer layer: ratio 1, {documents} documents a row, backend {attn}, {device}\n")
    print("| row | impl | ms | peak GiB |\n| ---: | --- | ---: | ---: |")
    default = packed_indexer.BAND_ELEMENTS
    measured = []
    try:
        for row in rows:
            cases = [("upstream", None)] + [(f"plugin 2^{e}", 1 << e) for e in (22, 24, 26)]
            for name, budget in cases:
                packed_indexer.BAND_ELEMENTS = budget or default

                def run(name=name):
                    layer, inputs, _ = build(1, row, documents, name != "upstream", device, attn)
                    return timed(lambda: layer(**inputs), device, repeats)

                result = guarded(run)
                if isinstance(result, str):
                    measured.append({"row": row, "impl": name, "error": result})
                    cell = f"{result} | "
                else:
                    measured.append({"row": row, "impl": name, "ms": result[0], "peak_gib": result[1]})
                    cell = f"{result[0]:.2f} | {result[1]:.2f}"
                print(f"| {row // 1024}k | {name} | {cell} |", flush=True)
    finally:
        packed_indexer.BAND_ELEMENTS = default
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--attn", choices=["tilelang", "sdpa", "eager"], help="default: tilelang if it imports")
    parser.add_argument("--quick", action="store_true", help="small sizes: check the script, not the GPU")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available here (use --device cpu --quick to check)")
    attn = args.attn or ("tilelang" if args.device == "cuda" and tilelang_available() else "eager")
    if args.device == "cuda":
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    row, documents = (512, [1, 64]) if args.quick else (8192, [1, 64, 512])
    rows = [4096] if args.quick else [16384, 65536, 131072]
    repeats = 1 if args.quick else 5
    capture_rows(args.device, attn if args.device == "cuda" else "eager", row, documents, repeats)
    indexer_rows(args.device, attn if args.device == "cuda" else "eager", rows, 256 if not args.quick else 16, repeats)


if __name__ == "__main__":
    main()
