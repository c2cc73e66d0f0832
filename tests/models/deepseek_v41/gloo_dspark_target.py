"""Worker for two-rank gloo tests of the DSpark target (launched by tests/conftest.run_gloo).

Scenarios:
  layout   - sync_across_ranks on very different documents: equal widths, exact own layout.
  forward  - HybridEP-reporting target: equal packed widths; features equal each document alone.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist
from dspark_checks import assert_documents_match_alone

from nemo_automodel_ext.models.deepseek_v41.dspark_target import aligned_packed_layout, dspark_packed_forward
from nemo_automodel_ext.models.deepseek_v41.packing import packed_layout
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target

# Rank 0 holds short documents whose lengths are not multiples of 4; rank 1 one long document.
LENGTHS = {0: [[3, 5, 1, 0], [2, 7, 0, 0]], 1: [[9, 0, 0, 0], [4, 4, 1, 0]]}


def gather_widths(width: int) -> list[int]:
    widths = [None] * dist.get_world_size()
    dist.all_gather_object(widths, width)
    return widths


def scenario_layout(rank: int) -> None:
    seq_lens = torch.tensor(LENGTHS[rank])
    layout = aligned_packed_layout(seq_lens, (2, 9), 4, sync_across_ranks=True)
    widths = gather_widths(layout.source_indices.shape[1])
    assert widths[0] == widths[1], widths
    local = packed_layout(seq_lens, None, (2, 9), 4, minimum_length=9)
    expected = packed_layout(seq_lens, None, (2, 9), 4, minimum_length=widths[0])
    assert layout.source_indices.shape[1] >= local.source_indices.shape[1]
    for field in ("source_indices", "input_positions", "position_ids", "sequence_ids"):
        assert torch.equal(getattr(layout, field), getattr(expected, field)), field
    unsynced = aligned_packed_layout(seq_lens, (2, 9), 4, sync_across_ranks=False)
    assert unsynced.source_indices.shape[1] == local.source_indices.shape[1]
    # Very different local widths (16 vs 12): the sync really changed something on rank 1.
    assert gather_widths(unsynced.source_indices.shape[1]) == [16, 12]
    # Extremes: a single one-token document against a long row of odd-length documents.
    lengths, shape = ([[1, 0]], (1, 1)) if rank == 0 else ([[61, 3]], (1, 64))
    extreme = aligned_packed_layout(torch.tensor(lengths), shape, 4, sync_across_ranks=True)
    assert gather_widths(extreme.source_indices.shape[1]) == [68, 68]
    own = packed_layout(torch.tensor(lengths), None, shape, 4, minimum_length=68)
    assert torch.equal(extreme.source_indices, own.source_indices)
    assert torch.equal(extreme.input_positions, own.input_positions)


def scenario_forward(rank: int) -> None:
    model = build_tiny_target(seed=0)
    # A test double: the MoE dispatcher stays "torch" on CPU, but the target reports HybridEP,
    # which is what switches dspark_packed_forward to rank-synchronised widths.
    model.backend = dataclasses.replace(model.backend, dispatcher="hybridep")
    wrapper = DeepseekV41DSparkTargetModel(model, model.config.text_config.dspark_target_layer_ids)
    generator = torch.Generator().manual_seed(100 + rank)
    seq_lens = torch.tensor(LENGTHS[rank])
    input_ids = torch.randint(4, 500, (2, 9), generator=generator)
    layout = dspark_packed_forward(model, input_ids, seq_lens)
    widths = gather_widths(layout.source_indices.shape[1])
    assert widths[0] == widths[1] == 16, widths
    batch = wrapper.generate_batch(input_ids, torch.ones_like(input_ids), torch.ones_like(input_ids), seq_lens=seq_lens)
    # Each document alone on the same weights without the rank sync (ranks hold different documents).
    alone = build_tiny_target(seed=0)
    alone_wrapper = DeepseekV41DSparkTargetModel(alone, alone.config.text_config.dspark_target_layer_ids)
    checked = assert_documents_match_alone(wrapper, batch, input_ids, seq_lens, alone_wrapper)
    assert checked == int((seq_lens > 0).sum())


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        {"layout": scenario_layout, "forward": scenario_forward}[sys.argv[1]](dist.get_rank())
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from gloo_exit import finish

    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
