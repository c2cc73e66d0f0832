"""Cost per useful token of each batching at V4.1-Flash scale, on paper: the step-time model over every
batching's own micro-batches (issue 25, item 5). A model, not a measurement: no GPU ran it.

Run: ``.venv/bin/python benchmarks/batching_at_scale.py`` (under a minute; nothing is allocated)

Two length distributions, sampled with a fixed seed (``SCALE_MIXES``):

- **long-tailed chat**: lognormal tokens, median 200, sigma 1.0, in [16, 4,096] (a few documents near the
  4k longest; length grouping cannot make every batch uniform);
- **64k rows**: lognormal, median 4,096, sigma 1.2, in [256, 65,536]: on H100 its longest documents fit a
  GPU only under CP, which the unpacked path does not have.

Each batching lays out its micro-batches as the recipe does (``micro_batches``):

- ``packed``: upstream's greedy packing into the recipe's rows (``pack_rows``, pinned to upstream's
  ``build_packed_eagle3_dataset`` by ``tests/test_batching_at_scale.py``), at the recipe's CP;
- ``grouped`` and ``dynamic``: the recipe's ``TokenBudgetBatchSampler`` (length-grouped and uniform order)
  with the packed micro-batch's tokens a GPU as the budget, at CP 1;
- ``upstream``: every conversation padded to ``seq_length``, the mix's longest, ``budget // seq_length``
  rows a micro-batch.

A document longer than one GPU holds at CP 1 (``longest_single``: the widest one-row micro-batch the memory
model fits with 10% to spare) is lost to the unpacked batchings: dropped by ``grouped`` and ``dynamic``,
truncated to ``seq_length`` by ``upstream``. Useful tokens are the real tokens a batching trains.

Every micro-batch's seconds come from ``planning/step_time.step_time`` at the recipe's GPUs, EP and draft EP,
with no overlap (how the shipped layouts are chosen); a packed row's indexer scores each query against its own
document (``documents``); a data-parallel step lasts as long as its slowest rank's micro-batch; anchors keep the
recipe's density (2,048 a 64k row) of each row's width. Assumptions, all the step-time model's or stated here:

- the target's forward at an assumed 40% of the bf16 peak, the draft's step at the 5.1% an H200 measured,
  vendor link bandwidths; compute on padding costs what it costs on real tokens;
- every micro-batch pays the target's full FSDP all-gather (the frozen target reshards after each forward);
- the unpacked micro-batches are costed at their own token counts, as if HybridEP took unequal counts from
  its ranks; a dispatcher that pads every rank to the budget would only add to their cost.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCHINGS = ("packed", "grouped", "dynamic", "upstream")
WIDTH_STEP = 1024  # longest_single's search step


@dataclass(frozen=True)
class ScaleMix:
    """A lognormal length distribution: ``median`` tokens, ``sigma`` of the log, clipped to [low, high]."""

    name: str
    median: float
    sigma: float
    low: int
    high: int
    documents: int


SCALE_MIXES = {
    "longtail": ScaleMix("long-tailed chat", 200, 1.0, 16, 4096, 200_000),
    "rows64k": ScaleMix("64k rows", 4096, 1.2, 256, 65536, 16_000),
}
CASES = (  # (mix, GPU preset, nodes, recipe)
    ("longtail", "H200", 4, "dspark_flash_h200_4node.yaml"),
    ("longtail", "H100", 8, "dspark_flash_h100_8node_cp.yaml"),
    ("rows64k", "H200", 4, "dspark_flash_h200_4node.yaml"),
    ("rows64k", "H100", 8, "dspark_flash_h100_8node_cp.yaml"),
)


def sample_lengths(mix: ScaleMix, seed: int = 0) -> list[int]:
    """``mix.documents`` document lengths, lognormal and clipped (seeded: the same list every run)."""
    rng = random.Random(seed)
    mu = math.log(mix.median)
    return [max(mix.low, min(mix.high, round(math.exp(rng.gauss(mu, mix.sigma))))) for _ in range(mix.documents)]


def pack_rows(lengths: list[int], row: int) -> list[list[int]]:
    """Upstream's greedy packing (``build_packed_eagle3_dataset``) on lengths alone: documents in order, a row
    flushed when the next would overflow it, a longer document truncated to the row.

    Returns:
        Each row's real document lengths; upstream's ``seq_lens`` are these with the row's padding folded
        into the last (``folded``).
    """
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0  # tokens of ``current``
    for length in lengths:
        length = min(int(length), row)
        if current and used + length > row:
            rows.append(current)
            current, used = [], 0
        current.append(length)
        used += length
    if current:
        rows.append(current)
    return rows


def folded(documents: list[int], row: int) -> list[int]:
    """A packed row's ``seq_lens``: ``documents`` with the row's padding folded into the last."""
    return documents[:-1] + [documents[-1] + row - sum(documents)]


@dataclass(frozen=True)
class MicroBatch:
    """One rank's micro-batch: ``rows x width`` captured tokens, ``real`` of them real; ``documents`` the
    packed row's ``seq_lens`` (None: one document a row)."""

    rows: int
    width: int
    real: int
    documents: tuple[int, ...] | None = None


def longest_single(counts, layout, gpu) -> int:
    """The widest one-row, CP 1 micro-batch the memory model fits with ``FIT_MARGIN`` to spare (a multiple of
    ``WIDTH_STEP``, at most ``layout.row_tokens``): the longest document the unpacked path can train."""
    from nemo_automodel_ext.planning.memory_model import estimate
    from nemo_automodel_ext.planning.step_time import FIT_MARGIN

    best = 0
    for width in range(WIDTH_STEP, layout.row_tokens + 1, WIDTH_STEP):
        fitted = estimate(counts, unpacked_layout(layout, 1, width, gpu))
        if fitted.headroom < FIT_MARGIN * fitted.usable:
            break
        best = width
    return best


def unpacked_layout(layout, rows: int, width: int, gpu, real: int | None = None):
    """``layout`` at CP 1 with ``rows x width`` tokens and the recipe's anchors per real token (``real``, default
    every token), spread over the rows (at least one a row)."""
    anchors = math.ceil((rows * width if real is None else real) * layout.anchors_per_row / layout.row_tokens)
    return replace(
        layout, cp=1, rows=rows, row_tokens=width, anchors_per_row=max(1, -(-anchors // rows)), gpu_gib=gpu.memory_gib
    )


def micro_batches(batching: str, lengths: list[int], layout, limit: int) -> tuple[list[MicroBatch], int]:
    """Every micro-batch of one epoch of ``batching`` over ``lengths`` (see the module docstring).

    Args:
        batching: One of ``BATCHINGS``.
        lengths: Document lengths.
        layout: The recipe's ``Layout`` (packed rows, CP, ranks).
        limit: ``longest_single``: the longest document an unpacked row may hold.

    Returns:
        The micro-batches (rank r of a step takes the r-th of each run of data-parallel ranks) and the
        real tokens the batching cannot train.
    """
    from nemo_automodel_ext.run.batching import TokenBudgetBatchSampler

    if batching == "packed":
        rows = pack_rows(lengths, layout.row_tokens)
        batches = []
        for i in range(0, len(rows), layout.rows):
            group = rows[i : i + layout.rows]
            group += [[layout.row_tokens]] * (layout.rows - len(group))  # a last micro-batch's padding rows
            documents = tuple(d for documents in group for d in folded(documents, layout.row_tokens))
            batches.append(
                MicroBatch(layout.rows, layout.row_tokens, sum(map(sum, rows[i : i + layout.rows])), documents)
            )
        return batches, sum(max(0, length - layout.row_tokens) for length in lengths)
    budget = layout.rows * layout.row_tokens // layout.cp
    if batching == "upstream":
        width = min(max(lengths), limit)
        rows = max(1, budget // width)
        kept = [min(length, width) for length in lengths]
        batches = [MicroBatch(rows, width, sum(kept[i : i + rows])) for i in range(0, len(kept), rows)]
        return batches, sum(lengths) - sum(kept)
    kept = [length for length in lengths if length <= limit]
    sampler = TokenBudgetBatchSampler(
        kept, budget, grouped=batching == "grouped", shuffle=True, seed=0, epochs=1, num_replicas=layout.gpus
    )
    batches = [
        MicroBatch(len(batch), max(kept[i] for i in batch), sum(kept[i] for i in batch))
        for batch in sampler.epoch_batches(0)
    ]
    return batches, sum(lengths) - sum(kept)


@dataclass(frozen=True)
class Cost:
    """One batching's epoch: ``seconds`` of wall clock on ``gpus`` GPUs, ``useful`` real tokens trained,
    ``captured`` tokens run through the target, ``lost`` real tokens it could not train, ``unfit`` micro-batches
    the memory model does not fit."""

    batching: str
    cp: int
    micro_batches: int
    seconds: float
    gpus: int
    useful: int
    captured: int
    lost: int
    unfit: int

    @property
    def useful_per_gpu_s(self) -> float:
        return self.useful / (self.seconds * self.gpus)

    @property
    def gpu_hours_per_billion(self) -> float:
        return self.seconds * self.gpus / 3600 / (self.useful / 1e9)


def cost(batching: str, lengths: list[int], counts, layout, gpu, text, limit: int) -> Cost:
    """``micro_batches`` timed by ``step_time``; a step lasts its slowest rank's micro-batch."""
    from nemo_automodel_ext.planning.step_time import step_time

    batches, lost = micro_batches(batching, lengths, layout, limit)
    packed = batching == "packed"
    ranks = layout.gpus // (layout.cp if packed else 1)

    @lru_cache(maxsize=None)
    def unpacked(rows: int, width: int, real: int):
        return step_time(counts, unpacked_layout(layout, rows, width, gpu, real), gpu, text)

    timed = [
        step_time(counts, replace(layout, gpu_gib=gpu.memory_gib), gpu, text, batch.documents)
        if packed
        else unpacked(batch.rows, batch.width, batch.real)
        for batch in batches
    ]
    seconds = sum(max(t.step_s for t in timed[i : i + ranks]) for i in range(0, len(timed), ranks))
    return Cost(
        batching,
        layout.cp if packed else 1,
        len(batches),
        seconds,
        layout.gpus,
        sum(batch.real for batch in batches),
        sum(batch.rows * batch.width for batch in batches),
        lost,
        sum(not t.memory.fits for t in timed),
    )


def case_costs(mix_name: str, gpu_name: str, nodes: int, recipe: str) -> tuple[list[Cost], int, object]:
    """Every batching's ``Cost`` for one case of ``CASES``, with ``longest_single`` and the recipe's layout."""
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    from nemo_automodel_ext.planning.layouts import layout_from_config
    from nemo_automodel_ext.planning.memory_model import model_counts
    from nemo_automodel_ext.planning.step_time import GPUS
    from nemo_automodel_ext.run.config import validate_recipe_config

    text = DeepseekV41TextConfig()
    counts = model_counts(text)
    gpu = GPUS[gpu_name]
    gpus = nodes * gpu.per_node
    cfg = load_yaml_config(str(REPO / "recipes" / "deepseek_v41" / recipe))
    args = validate_recipe_config(cfg, gpus, "cuda", require_packages=False)
    layout = layout_from_config(cfg, args, gpus, gpu.memory_gib)
    limit = longest_single(counts, layout, gpu)
    lengths = sample_lengths(SCALE_MIXES[mix_name])
    return [cost(b, lengths, counts, layout, gpu, text, limit) for b in BATCHINGS], limit, layout


def render(mix_name: str, gpu_name: str, nodes: int, recipe: str, costs: list[Cost], limit: int, layout) -> str:
    mix = SCALE_MIXES[mix_name]
    packed = costs[0]
    total = packed.useful + packed.lost  # every batching's useful + lost tokens are the mix's
    lines = [
        f"**{mix.name}** ({mix.documents:,} documents, {total:,} tokens, median {mix.median:g}, at most "
        f"{mix.high:,}) on **{gpu_name} x {nodes * 8}** (`{recipe}`: EP {layout.ep}, CP {layout.cp}, "
        f"{layout.rows} x {layout.row_tokens:,} tokens a micro-batch); one GPU holds a document of at most "
        f"{limit:,} tokens at CP 1",
        "",
        "| batching | CP | micro-batches | real share of captured | tokens it cannot train | useful tokens/s a GPU "
        "| GPU-hours per 1B useful tokens | cost / packed's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in costs:
        lost = f"{c.lost / total:.1%}" if c.lost else "0"
        note = f" ({c.unfit} do not fit)" if c.unfit else ""
        lines.append(
            f"| {c.batching} | {c.cp} | {c.micro_batches:,}{note} | {c.useful / c.captured:.0%} | {lost} | "
            f"{c.useful_per_gpu_s:,.0f} | {c.gpu_hours_per_billion:,.0f} | "
            f"{c.gpu_hours_per_billion / packed.gpu_hours_per_billion:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    from nemo_automodel_ext.planning.step_time import DRAFT_MFU, MFU

    print(
        f"A model, not a measurement: the step-time model (target forward at an assumed {MFU:.0%} of the bf16 peak, "
        f"draft step at the measured {DRAFT_MFU:.1%}, no overlap) over each batching's own micro-batches of one "
        "epoch (benchmarks/batching_at_scale.py; assumptions in its docstring).\n"
    )
    for case in CASES:
        costs, limit, layout = case_costs(*case)
        print(render(*case, costs, limit, layout) + "\n")


if __name__ == "__main__":
    main()
