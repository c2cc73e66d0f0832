"""Step time and tokens/s a GPU of packed DSpark on V4.1-Flash: the shipped recipes and the fastest layout that fits.

Run: ``.venv/bin/python benchmarks/step_time.py`` (a few seconds; nothing is allocated).

For each GPU preset (H100, H200, B200; ``planning/step_time.py``) at the node count given, every EP, CP
and draft EP size is estimated (the target's FLOPs at an assumed 40% of the dense bf16 peak, the draft's at the
5.1% an H200 measured, each traffic entry over the link it crosses) and the layout with the most packed tokens a
second a GPU with no overlap, among those that fit with 10% of the usable memory to spare, is printed part by
part beside the shipped recipe for that GPU, with the full-overlap and network-only bounds and one target
layer's gather against its compute. Rows of 64k tokens, one row a micro-batch, 2,048 anchors a row.
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = (
    ("H100", 8, "dspark_flash_h100_8node_cp.yaml"),
    ("H200", 4, "dspark_flash_h200_4node.yaml"),
    ("B200", 4, None),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    from nemo_automodel_ext.planning.layouts import layout_from_config
    from nemo_automodel_ext.planning.memory_model import GIB, Layout, model_counts
    from nemo_automodel_ext.planning.step_time import DRAFT_MFU, GPUS, MFU, fastest_fitting, step_time
    from nemo_automodel_ext.run.config import validate_recipe_config

    text = DeepseekV41TextConfig()
    counts = model_counts(text)
    rows = []
    for name, nodes, recipe in PRESETS:
        gpu = GPUS[name]
        gpus = nodes * gpu.per_node
        if recipe is not None:
            cfg = load_yaml_config(str(REPO / "recipes" / "deepseek_v41" / recipe))
            args = validate_recipe_config(cfg, gpus, "cuda", require_packages=False)
            rows.append(
                (
                    f"{name} x {gpus}: {recipe}",
                    step_time(counts, layout_from_config(cfg, args, gpus, gpu.memory_gib), gpu, text),
                )
            )
        start = Layout(gpus, gpu.memory_gib, gpus, 1, 1, 65536, 2048)
        best = fastest_fitting(counts, start, gpu, text)
        rows.append((f"{name} x {gpus}: fastest that fits", best))
    print(
        f"Target forward at an assumed {MFU:.0%} of the dense bf16 peak, the draft step at the measured "
        f"{DRAFT_MFU:.1%} (planning/step_time.py). Tokens/s a GPU at three step times: no overlap (compute + "
        "every transfer: layouts are chosen by it), full overlap (the longer of the two), and the network alone "
        "(a bound no layout passes).\n"
    )
    print(
        "| GPUs: layout | EP | CP | draft EP | GiB a GPU | compute s | comm s | network s | slowest link "
        "| tokens/s no overlap | full overlap | network only | layer gather / compute ms |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"
    )
    for label, timed in rows:
        if timed is None:
            print(f"| {label} | - | - | - | none fits | | | | | | | | |")
            continue
        layout = timed.memory.layout
        links = {k: v for k, v in timed.seconds.items() if k != "compute"}
        slowest = max(links, key=links.get)
        gather, compute = timed.gather_budget
        network = f"{timed.tokens_per_s(timed.network_s):,.0f}" if timed.network_s else "no network"
        print(
            f"| {label} | {layout.ep} | {layout.cp} | {layout.draft_ep} | {timed.memory.total / GIB:.1f} | "
            f"{timed.compute_s:.2f} | {timed.communication_s:.2f} | {timed.network_s:.2f} | "
            f"{slowest} {links[slowest]:.2f} s | {timed.tokens_per_s():,.0f} | "
            f"{timed.tokens_per_s(timed.overlapped_s):,.0f} | {network} | {gather * 1e3:.0f} / {compute * 1e3:.0f} |"
        )
    print("\nTFLOP a GPU a micro-batch, by part:\n")
    parts = list(rows[0][1].flops)
    print("| GPUs: layout | " + " | ".join(parts) + " |\n| --- |" + " ---: |" * len(parts))
    for label, timed in rows:
        if timed is not None:
            print(f"| {label} | " + " | ".join(f"{timed.flops[p] / 1e12:.1f}" for p in parts) + " |")


if __name__ == "__main__":
    main()
