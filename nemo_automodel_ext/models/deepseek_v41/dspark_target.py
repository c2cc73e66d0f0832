"""Packed DSpark target forward for DeepSeek V4.1.

V4.1's compressed attention stays inside a packed document only when every document
starts on a compression-group boundary, and HybridEP needs the same token count from
every rank. ``aligned_packed_layout`` lays rows out under both rules and
``dspark_packed_forward`` runs the frozen target on them with the prepared
``packed_seq_ids`` path of ``DeepseekV41ForCausalLM.forward``, never a 4-D mask.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer
from nemo_automodel_ext.models.deepseek_v41.packing import PackedSequenceLayout, plan_packed_layout, round_up

_TOKEN_DTYPES = (torch.int32, torch.int64)


def require_v41_target(model: object) -> DeepseekV41ForCausalLM:
    """Return ``model`` if it is a ``DeepseekV41ForCausalLM``, else raise a ValueError saying what to use."""
    if not isinstance(model, DeepseekV41ForCausalLM):
        raise ValueError(
            f"model must be a DeepseekV41ForCausalLM DSpark target, got {type(model).__name__}; "
            "other targets use nemo_automodel's HFDSparkTargetModel"
        )
    return model


def compression_alignment(model: nn.Module) -> int:
    """Least common multiple of the active compression ratios of a V4.1 target.

    Args:
        model: ``DeepseekV41ForCausalLM``; only its config is read.

    Returns:
        Positive int: the document alignment that keeps every compressed group inside its
        document (1 when no active layer compresses).
    """
    text = require_v41_target(model).config.text_config
    return math.lcm(*(ratio for ratio in text.compress_ratios[: text.num_hidden_layers] if ratio))


def uses_hybridep(model: nn.Module) -> bool:
    """Whether the target's MoE dispatcher is HybridEP, which needs equal token counts on every rank."""
    return getattr(getattr(model, "backend", None), "dispatcher", None) == "hybridep"


def max_over_ranks(value: int, group: dist.ProcessGroup | None = None) -> int:
    """Max-reduce a host integer over ``group`` (the default group); identity without one.

    Args:
        value: This rank's integer.
        group: Process group, or None for the default group.

    Returns:
        The largest ``value`` of all ranks, or ``value`` itself when torch.distributed is not
        initialised or the group has one rank.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    reduced = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return int(reduced.item())


def aligned_packed_layout(
    seq_lens: torch.Tensor,
    input_shape: tuple[int, int],
    alignment: int,
    sync_across_ranks: bool,
) -> PackedSequenceLayout:
    """Lay out packed rows with every document starting on a compression-group boundary.

    Args:
        seq_lens: Integer document lengths of shape [batch, documents]; zero and -1000
            entries denote absent documents.
        input_shape: Original [batch, sequence] dimensions; the aligned rows are at least
            `sequence` tokens wide.
        alignment: Positive multiple for each document's physical span. A compressed group
            must start where the document's first group would start on its own, so this
            is the least common multiple of the active compression ratios.
        sync_across_ranks: Max-reduce the row length over the default process group.
            HybridEP needs the same token count from every rank, and rows of the same
            width need different amounts of alignment padding.

    Returns:
        Layout of the aligned rows; its tensors have shape [batch, aligned_sequence]
        (``input_positions``: [batch, sequence]), new int64 tensors on ``seq_lens.device``.

    Raises:
        ValueError: for the inputs ``packed_layout`` refuses, naming the argument and the rule.
    """
    return _aligned_layout(seq_lens, input_shape, alignment, sync_across_ranks)


def _aligned_layout(
    seq_lens: torch.Tensor,
    input_shape: tuple[int, int],
    alignment: int,
    sync_across_ranks: bool,
    width_multiple: int = 1,
) -> PackedSequenceLayout:
    """``aligned_packed_layout`` whose width is also a multiple of ``width_multiple`` (CP shards)."""
    if not isinstance(sync_across_ranks, bool):
        raise ValueError(f"sync_across_ranks must be a bool, got {sync_across_ranks!r}")
    plan = plan_packed_layout(seq_lens, None, input_shape, alignment)
    width = round_up(plan.width(minimum_length=plan.input_shape[1]), math.lcm(plan.alignment, width_multiple))
    if sync_across_ranks:
        width = max_over_ranks(width)
    return plan.build(width)


def validate_packed_batch(model: DeepseekV41ForCausalLM, input_ids: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Refuse, with a ValueError naming the argument and the rule, a packed batch ``dspark_packed_forward`` cannot run.

    Args:
        model: ``DeepseekV41ForCausalLM`` target (its image token id is read).
        input_ids: Token IDs [batch, sequence], int32/int64, at least one row and one token, no image token.
        seq_lens: Document lengths [batch, documents], int32/int64, each row summing to ``sequence``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in _TOKEN_DTYPES or input_ids.ndim != 2:
        raise ValueError(
            "input_ids must be an int32/int64 tensor of shape [batch, sequence], got "
            + (
                f"{input_ids.dtype} {tuple(input_ids.shape)}"
                if isinstance(input_ids, torch.Tensor)
                else repr(input_ids)
            )
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one row and one token (got shape {tuple(input_ids.shape)})")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype not in _TOKEN_DTYPES:
        raise ValueError("seq_lens must be an int32/int64 tensor of document lengths [batch, documents]")
    if seq_lens.ndim != 2 or seq_lens.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"seq_lens must have shape [batch={input_ids.shape[0]}, documents], got {tuple(seq_lens.shape)}"
        )
    row_tokens = seq_lens.clamp_min(0).sum(1)
    image_token_id = getattr(model.config, "image_token_id", None)
    # One host read for both input rules.
    short_rows, image_tokens = torch.stack(
        [
            (row_tokens != input_ids.shape[1]).sum(),
            (input_ids == image_token_id).sum() if image_token_id is not None else row_tokens.new_zeros(()),
        ]
    ).tolist()
    if short_rows:
        raise ValueError(
            f"seq_lens rows must sum to the packed sequence length {input_ids.shape[1]}; got row sums "
            f"{row_tokens.tolist()} (put trailing padding in its own document)"
        )
    if image_tokens:
        raise ValueError(
            f"input_ids contain the image token id {image_token_id}: packed DSpark capture is text-only; "
            "run image batches unpacked"
        )


def prepare_packed_inputs(
    model: DeepseekV41ForCausalLM, input_ids: torch.Tensor, seq_lens: torch.Tensor, width_multiple: int = 1
) -> tuple[PackedSequenceLayout, dict[str, torch.Tensor]]:
    """Validate a packed batch and build the aligned forward inputs of ``dspark_packed_forward``.

    Args:
        model: ``DeepseekV41ForCausalLM`` target.
        input_ids: Token IDs [batch, sequence].
        seq_lens: Document lengths [batch, documents], rows summing to ``sequence``.
        width_multiple: Extra multiple for the aligned width (the CP sharder's divisor).

    Returns:
        The layout and new tensors ``input_ids`` (pad-filled), ``attention_mask`` (bool),
        ``position_ids`` and ``packed_seq_ids``, all [batch, aligned_sequence].
    """
    validate_packed_batch(model, input_ids, seq_lens)
    layout = _aligned_layout(
        seq_lens.to(input_ids.device),
        tuple(input_ids.shape),
        compression_alignment(model),
        uses_hybridep(model),
        width_multiple,
    )
    inputs = {
        "input_ids": layout.pack(input_ids, fill=model.config.text_config.pad_token_id or 0),
        "attention_mask": layout.sequence_ids > 0,
        "position_ids": layout.position_ids,
        "packed_seq_ids": layout.sequence_ids,
    }
    return layout, inputs


def dspark_packed_forward(model: nn.Module, input_ids: torch.Tensor, seq_lens: torch.Tensor) -> PackedSequenceLayout:
    """Run a frozen DeepSeek V4.1 forward on packed rows for DSpark feature capture.

    Documents are aligned as in the `seq_lens` path of the model's `forward`, and the
    prepared `packed_seq_ids` keep every attention path inside its document. With the
    HybridEP dispatcher every rank pads to the longest aligned row of all ranks. DSpark
    reads hooked activations, so only the last position's logits are projected.

    The model's indexers are switched to the plugin's ``PackedIndexer`` before the forward
    (``install_packed_indexer``: idempotent, in place, the same selection as upstream's on
    tie-free scores): banded scores and one vectorised selection per layer, so the host reads
    and kernels of a capture do not grow with the documents in a row, as upstream's
    per-document selection loop does. A model that already has them is left as it is.

    Args:
        model: `DeepseekV41ForCausalLM` target; its indexers become ``PackedIndexer`` (in place).
        input_ids: Token IDs of shape [batch, sequence] holding packed documents.
        seq_lens: Document lengths of shape [batch, documents]; each row sums to
            `sequence` and zero entries pad the document axis.

    Returns:
        Layout whose `restore` maps a tensor of shape [batch, aligned_sequence, ...] captured
        by hooks during this forward back to [batch, sequence, ...]. The forward builds no
        autograd graph, leaves no parameter gradients and does not modify its inputs.

    Raises:
        ValueError: for a model that is not a V4.1 target, wrong shapes or dtypes, rows of
            ``seq_lens`` that do not sum to ``sequence``, or image tokens.
    """
    target = require_v41_target(model)
    install_packed_indexer(target)
    layout, inputs = prepare_packed_inputs(target, input_ids, seq_lens)
    with torch.no_grad():
        target(**inputs, logits_to_keep=1)
    return layout


__all__ = [
    "aligned_packed_layout",
    "compression_alignment",
    "dspark_packed_forward",
    "max_over_ranks",
    "prepare_packed_inputs",
    "require_v41_target",
    "uses_hybridep",
    "validate_packed_batch",
]
