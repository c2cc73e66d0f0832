"""Context parallelism for packed DSpark capture on a V4.1 target.

The pack is aligned once with the plugin's layout, its width rounded to the CP sharder's
divisor (``cp_size * max(alignment, 2)``, so every shard holds whole compression groups),
then cut into contiguous shards by the framework's ``shard_batch_contiguous`` (the
contract of 0.7.0's ``deepseek_v41/cp.py``). After the forward, captured activations are
gathered back to the full aligned sequence with ``gather_sequence`` and restored to the
caller's coordinates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from nemo_automodel.components.distributed.context_parallel.sharder import shard_batch_contiguous
from nemo_automodel.components.models.deepseek_v41.cp import gather_sequence
from torch.distributed.device_mesh import DeviceMesh

from nemo_automodel_ext.models.deepseek_v41.dspark_target import (
    compression_alignment,
    prepare_packed_inputs,
    require_v41_target,
)
from nemo_automodel_ext.models.deepseek_v41.packing import PackedSequenceLayout


def cp_width_multiple(alignment: int, cp_size: int) -> int:
    """The CP sharder's divisor for a packed width: whole compression groups on every rank."""
    return cp_size * max(alignment, 2)


def dspark_packed_forward_cp(
    model: nn.Module, input_ids: torch.Tensor, seq_lens: torch.Tensor, cp_mesh: DeviceMesh
) -> tuple[PackedSequenceLayout, Callable[[torch.Tensor], torch.Tensor]]:
    """``dspark_packed_forward`` with the aligned sequence sharded contiguously over ``cp_mesh``.

    Every CP rank passes the same full batch; each runs the target on its shard.

    Args:
        model: ``DeepseekV41ForCausalLM`` target.
        input_ids: Token IDs [batch, sequence], identical on every CP rank.
        seq_lens: Document lengths [batch, documents], rows summing to ``sequence``.
        cp_mesh: One-dimensional context-parallel mesh.

    Returns:
        The full aligned layout, and ``restore``: maps a tensor captured on this rank,
        [batch, aligned_sequence / cp_size, ...], to the caller's [batch, sequence, ...]
        (an all-gather over the CP group, so every CP rank must call it, in the same order).
    """
    target = require_v41_target(model)
    cp_size = cp_mesh.size()
    alignment = compression_alignment(target)
    layout, inputs = prepare_packed_inputs(target, input_ids, seq_lens, cp_width_multiple(alignment, cp_size))
    width = layout.source_indices.shape[1]
    batch = {
        "input_ids": inputs["input_ids"],
        "position_ids": inputs["position_ids"],
        "packed_seq_ids": inputs["packed_seq_ids"],
        "padding_mask": ~inputs["attention_mask"],
    }
    _, local, shard = shard_batch_contiguous(
        cp_mesh,
        None,
        batch,
        loss_mask=inputs["attention_mask"].long(),  # the sharder needs a label stream; capture ignores it
        padding_token_id=target.config.text_config.pad_token_id or 0,
        pad_multiple=alignment,
        extra_seq_keys={"packed_seq_ids": 1},
        extra_pad_values={"packed_seq_ids": 0},
    )
    if shard.padded_seq_len != width:
        raise RuntimeError(f"CP sharder padded the aligned width {width} to {shard.padded_seq_len}")
    group = cp_mesh.get_group()
    with torch.no_grad():
        target(
            local["input_ids"],
            attention_mask=~local["padding_mask"],
            position_ids=local["position_ids"],
            packed_seq_ids=local["packed_seq_ids"],
            cp_group=group,
            logits_to_keep=1,
        )

    def restore(values: torch.Tensor) -> torch.Tensor:
        return layout.restore(gather_sequence(values, group))

    return layout, restore


__all__ = ["cp_width_multiple", "dspark_packed_forward_cp"]
