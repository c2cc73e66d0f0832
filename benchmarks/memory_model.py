"""Per-GPU memory and per-step traffic of packed DSpark on DeepSeek-V4.1-Flash, from the memory model.

Run: ``.venv/bin/python benchmarks/memory_model.py [RECIPE_YAML ...] [--gpus N --gpu-gib G]``

For each recipe YAML (default: the shipped GPU recipes) it reads the layout (EP, CP, rows,
anchors, strategy) and prints:

1. the recipe's own estimate: what every phase holds, then each phase's own parts (capture, draft
   step, optimizer step) with the phase's total, the peak, its headroom, and the bytes one GPU sends
   per micro-batch;
2. the per-GPU total for V4.1-Flash rows of 16k, 64k and 128k tokens at CP 1, 2, 4 and 8
   (``*``: fits), CP-native (each rank its shard's features and anchors) next to the
   all-gathered features and full draft on every rank it replaced;
3. one indexer layer's bytes, upstream's whole-row scores against the plugin's bands.

The target config is the recipe's when ``target_model_name_or_path`` is a local folder, else
upstream's ``DeepseekV41TextConfig`` defaults (the released V4.1-Flash). Nothing is downloaded
or allocated: parameter counts come from meta-device builds, activation bytes from the measured
``planning/calibration.json`` (``benchmarks/memory_calibration.py``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = {  # ranks and GiB a GPU each shipped GPU recipe is laid out for
    "dspark_flash_h200_4node.yaml": (32, 141),
    "dspark_flash_h100_8node_cp.yaml": (64, 80),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", type=Path)
    parser.add_argument("--gpus", type=int, help="ranks (default: the recipe's launch size)")
    parser.add_argument("--gpu-gib", type=float, help="GiB a GPU (default: the recipe's GPUs)")
    options = parser.parse_args()
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    from nemo_automodel_ext.planning.layouts import layout_from_config
    from nemo_automodel_ext.planning.memory_model import GIB, Calibration, estimate, indexer_bytes, model_counts
    from nemo_automodel_ext.run.config import validate_recipe_config
    from nemo_automodel_ext.run.loading import target_text_config

    calibration_pair = Calibration.shipped().moe_pair
    recipes = options.recipes or [REPO / "recipes" / "deepseek_v41" / name for name in GPU_RECIPES]
    counted = {}
    for path in recipes:
        cfg = load_yaml_config(str(path))
        gpus, gib = GPU_RECIPES.get(path.name, (8, 80))
        gpus, gib = options.gpus or gpus, options.gpu_gib or gib
        args = validate_recipe_config(cfg, gpus, "cuda", require_packages=False)
        target = str(args["target_model_name_or_path"])
        text = target_text_config(target) if os.path.isdir(target) else DeepseekV41TextConfig()
        key = (target, int(args["num_anchors"]))
        counts = counted.setdefault(key, model_counts(text, int(args["num_anchors"])))
        layout = layout_from_config(cfg, args, gpus, gib)
        result = estimate(counts, layout)
        print(
            f"\n## {path.name}: {gpus} GPUs x {gib:g} GiB, ep {layout.ep}, cp {layout.cp}, "
            f"draft ep {layout.draft_ep}, {layout.row_tokens} a row"
        )
        print(
            f"target {counts.target / 1e9:.1f}B parameters ({counts.experts / 1e9:.1f}B routed experts, "
            f"{counts.engram / 1e9:.1f}B Engram tables, {counts.dense / 1e9:.1f}B other); draft "
            f"{counts.draft_trainable / 1e9:.1f}B trainable + {counts.draft_frozen / 1e9:.1f}B frozen"
        )
        print("\n| per GPU | GiB |\n| --- | ---: |")
        own = result.phases[result.peak_phase]
        for name, value in result.memory.items():
            if name not in own:
                print(f"| {name} | {value / GIB:.2f} |")
        for phase, parts in result.phases.items():
            mark = " (the peak)" if phase == result.peak_phase else ""
            print(f"| *{phase}{mark}: {result.phase_total(phase) / GIB:.1f} in all* | |")
            for name, value in parts.items():
                if value:
                    print(f"| &nbsp;&nbsp;{name} | {value / GIB:.2f} |")
        print(f"| **total (peak phase: {result.peak_phase})** | **{result.total / GIB:.1f}** |")
        print(f"| usable ({gib:g} GiB x 0.92) | {result.usable / GIB:.1f} |")
        print(f"| headroom | {result.headroom / GIB:.1f} |")
        extra = ", ".join(f"{phase} +{value / GIB:.1f}" for phase, value in result.imbalance.items() if value)
        tolerance = result.imbalance_tolerance()
        print(
            f"\nRouting imbalance (the totals assume balanced routing): +100% load on an expert group's busiest rank "
            f"adds at most {extra or 'nothing'} GiB (the capture's MoE block at the measured "
            f"{calibration_pair / 1e3:.0f} kB a routed pair; a draft layer's dispatch buffers and MoE block); "
            "this layout fits up to "
            + ("any load." if tolerance == float("inf") else f"+{100 * tolerance:.0f}% on the busiest rank.")
        )
        if result.engram_block:
            activations = result.phases["capture"]["capture activations (measured)"]
            print(
                f"\nEngram: one block at its peak holds {result.engram_block / GIB:.1f} GiB (its measured transients, "
                f"its residual input, the row-owner lookup's exchange) against the capture's measured "
                f"{activations / GIB:.1f} GiB, so "
                + (
                    "the capture's peak holds it."
                    if result.engram_block <= activations
                    else f"it adds {(result.engram_block - activations) / GIB:.1f} GiB to the capture phase."
                )
            )
        print("\n| sent per GPU per micro-batch | MiB |\n| --- | ---: |")
        for name, value in result.traffic.items():
            print(f"| {name} | {value / 2**20:,.1f} |")
        print(f"\nPer-GPU GiB (`*` fits in {result.usable / GIB:.1f}), {gpus} GPUs, ep {layout.ep}:\n")
        print("| row | features | CP 1 | CP 2 | CP 4 | CP 8 |\n| --- | --- | ---: | ---: | ---: | ---: |")
        for row in (16384, 65536, 131072):
            for native in (True, False):
                cells = []
                for cp in (1, 2, 4, 8):
                    case = estimate(counts, replace(layout, row_tokens=row, cp=cp, cp_native=native))
                    cells.append(f"{case.total / GIB:.1f}{'*' if case.fits else ''}")
                label = "CP-native halo" if native else "all-gather (before)"
                print(f"| {row // 1024}k | {label} | " + " | ".join(cells) + " |")
        ratio = counts.widths["min_ratio"]
        print("\nOne indexer layer, GiB per GPU: upstream's whole-row scores -> the plugin's bands")
        print("(`packed_indexer.py`), candidates kept for later layers included; one document a row (the")
        print("widest bands, what the totals above count) and 256 equal documents a row.\n")
        print("| row | documents | CP 1 | CP 2 | CP 4 | CP 8 |\n| --- | --- | ---: | ---: | ---: | ---: |")
        for row in (16384, 65536, 131072):
            for documents in (1, 256):
                cells = []
                for cp in (1, 2, 4, 8):
                    before = indexer_bytes(layout.rows, row, cp, ratio, banded=False) / GIB
                    after = indexer_bytes(layout.rows, row, cp, ratio, row // documents) / GIB
                    cells.append(f"{before:.1f} -> {after:.2f}")
                print(f"| {row // 1024}k | {documents} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
