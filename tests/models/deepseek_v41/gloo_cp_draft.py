"""Worker for the CP-native draft tests (launched by tests/conftest.run_gloo on 2 or 3 ranks).

All ranks form one CP group and hold the same packed batch. Each rank computes the CP=1
reference (whole-row capture, the draft on every anchor, one backward) and then the CP-native
step (its shard's capture, halos point to point, its shard's anchors only). The loss and
metrics must equal the reference on every rank, and the gradients summed over the group and
divided by its size (what DDP over dp x cp does) must equal the reference gradients. It also
asserts the local feature shapes and that the cases that can break a halo occurred: anchors
whose window or document crosses a shard boundary, and (second window) shards shorter than
the window, whose halo spans more than one peer.

``train STRATEGY``: three Adam steps of the recipe's parallelized draft (``parallelize_draft``
over the flattened dp x cp mesh, DDP or FSDP2) on CP-native batches: the draft's parameters
must stay identical on every CP peer and equal to three CP=1 steps on the same batches.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from dspark_checks import packing_tensors
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel_ext.models.deepseek_v41.anchors import select_packed_anchors
from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options
from nemo_automodel_ext.recipes.parallel import draft_mesh, parallelize_draft

# Aligned widths (alignment 4): row 0 -> 8 + 20 + 20 = 48, row 1 -> 12 + 4 + 28 = 44.
SEQ_LENS = torch.tensor([[5, 0, 17, 18, 0], [9, 3, 28, -1000, 0]])
SEQUENCE = 40
ANCHORS_PER_DOCUMENT = 6
METRICS = ("ce_loss", "l1_loss", "confidence_loss", "tau_num", "tau_den", "confidence_abs_error_num")


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        size = dist.get_world_size()
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
        model = build_tiny_target(seed=0)
        text = model.config.text_config
        layer_ids = text.dspark_target_layer_ids
        input_ids = torch.randint(4, 500, (2, SEQUENCE), generator=torch.Generator().manual_seed(7))
        position_ids, doc_remaining, loss_mask = packing_tensors(SEQ_LENS)
        originals = [t.clone() for t in (input_ids, position_ids, doc_remaining, loss_mask, SEQ_LENS)]
        single = DeepseekV41DSparkTargetModel(model, layer_ids).generate_batch(
            input_ids, torch.ones_like(input_ids), loss_mask, position_ids, SEQ_LENS, doc_remaining
        )
        wrapper = DeepseekV41DSparkTargetModel(model, layer_ids, cp_mesh=mesh)
        if sys.argv[1:2] == ["train"]:
            check_training(model, text, single, sys.argv[2], input_ids, position_ids, doc_remaining, loss_mask)
            return
        for window in (8, 40):  # 40 is longer than every shard at CP=2 and CP=3
            check_window(model, text, single, wrapper, window, input_ids, position_ids, doc_remaining, loss_mask)
        for before, after in zip(originals, (input_ids, position_ids, doc_remaining, loss_mask, SEQ_LENS)):
            assert torch.equal(before, after), "caller tensors were modified"
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check_window(model, text, single, wrapper, window, input_ids, position_ids, doc_remaining, loss_mask) -> None:
    size, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234)
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=8), anchors_per_document=ANCHORS_PER_DOCUMENT
    )
    draft.config.sliding_window = window
    draft.initialize_embeddings_and_head(embed_tokens=model.model.embed_tokens, lm_head=model.lm_head)
    block = draft.config.dspark_block_size
    reference = PackedDSparkTrainerModule(draft, loss_decay_gamma=2.0)
    native = copy.deepcopy(reference)

    torch.manual_seed(99)
    expected = reference(
        input_ids,
        single.target_hidden_states,
        loss_mask,
        single.target_last_hidden_states,
        position_ids,
        SEQ_LENS,
        doc_remaining,
    )
    expected.loss.backward()

    batch = wrapper.generate_shard_batch(
        input_ids, loss_mask, position_ids, SEQ_LENS, doc_remaining, before=window, after=block
    )
    shard = batch.shard
    local = shard.stop - shard.start
    aligned = shard.width
    assert aligned % size == 0 and shard.shard_width == aligned // size
    assert local == min(aligned, shard.shard_stop + block) - max(0, shard.shard_start - window)
    assert local <= aligned // size + window + block
    assert batch.target_hidden_states.shape == (2, local, len(text.dspark_target_layer_ids) * text.hidden_size)
    assert batch.target_last_hidden_states.shape == (2, local, text.hidden_size)
    if window == 8:
        assert local < aligned, f"rank {rank} holds the whole pack's features ({local} of {aligned} columns)"
    # At real tokens the halos hold exactly the whole-row capture (alignment padding is never read).
    real = (shard.layout.source_indices[:, shard.start : shard.stop] >= 0).unsqueeze(-1)
    features = slice(0, shard.shard_stop - shard.start)
    torch.testing.assert_close(
        (batch.target_hidden_states * real)[:, features],
        shard.local(single.target_hidden_states)[:, features],
        atol=1e-5,
        rtol=0,
    )
    teacher = slice(shard.shard_start - shard.start, local)
    torch.testing.assert_close(
        (batch.target_last_hidden_states * real)[:, teacher],
        shard.local(single.target_last_hidden_states)[:, teacher],
        atol=1e-5,
        rtol=0,
    )

    torch.manual_seed(99)
    actual = native(
        input_ids,
        batch.target_hidden_states,
        loss_mask,
        batch.target_last_hidden_states,
        position_ids,
        SEQ_LENS,
        doc_remaining,
        shard=shard,
    )
    actual.loss.backward()
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-6, rtol=1e-5)
    for name in METRICS:
        torch.testing.assert_close(getattr(actual, name), getattr(expected, name), atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(actual.accept_rate_per_pos_den, expected.accept_rate_per_pos_den)
    compared = 0
    for (name, ours), (_, theirs) in zip(native.named_parameters(), reference.named_parameters(), strict=True):
        if theirs.grad is None:
            assert ours.grad is None or not ours.grad.any(), name
            continue
        grad = ours.grad.clone() if ours.grad is not None else torch.zeros_like(theirs.grad)
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / size, theirs.grad, atol=2e-6, rtol=1e-4, msg=f"gradient of {name}")
        compared += 1
    assert compared > 10, compared

    # Coverage: the same draw as both steps made, restricted to this shard.
    torch.manual_seed(99)
    selected = select_packed_anchors(loss_mask, doc_remaining, SEQ_LENS, ANCHORS_PER_DOCUMENT)
    anchors, keep, starts = shard.own_anchors(selected, SEQ_LENS)
    global_anchors = anchors + shard.start
    crossing = keep & (global_anchors - window < shard.shard_start) & (starts + shard.start < shard.shard_start)
    counts = torch.tensor([int(keep.sum()), int(selected.sum()), int(crossing.any() and rank > 0)])
    spans = int(shard.shard_start - window < shard.shard_start - shard.shard_width and rank > 1)
    counts = torch.cat([counts, torch.tensor([spans])])
    dist.all_reduce(counts)
    assert counts[0] == counts[1] // size, f"shards hold {counts[0]} anchors, the CP=1 draw {counts[1] // size}"
    assert counts[2] >= 1, "no anchor's window and document crossed a shard boundary"
    if window == 40 and size == 3:
        assert counts[3] >= 1, "no halo spanned more than one peer"


def check_training(model, text, single, strategy, input_ids, position_ids, doc_remaining, loss_mask) -> None:
    size = dist.get_world_size()
    device_mesh = init_device_mesh("cpu", (1, size), mesh_dim_names=("dp", "cp"))
    wrapper = DeepseekV41DSparkTargetModel(model, text.dspark_target_layer_ids, cp_mesh=device_mesh["cp"])
    torch.manual_seed(1234)
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=8), anchors_per_document=ANCHORS_PER_DOCUMENT
    )
    draft.initialize_embeddings_and_head(embed_tokens=model.model.embed_tokens, lm_head=model.lm_head)
    reference = PackedDSparkTrainerModule(copy.deepcopy(draft), loss_decay_gamma=2.0)
    initial = {name: value.detach().clone() for name, value in reference.named_parameters()}
    native = parallelize_draft(
        PackedDSparkTrainerModule(draft, loss_decay_gamma=2.0),
        strategy,
        size,
        torch.device("cpu"),
        draft_mesh(device_mesh),
        torch.float32,
    )
    # SGD: an update proportional to the gradient (Adam's normalisation turns rounding noise on
    # near-zero gradients into full-size steps of either sign).
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, native)]
    block = text.dspark_block_size
    for step in range(3):
        torch.manual_seed(100 + step)
        reference(
            input_ids,
            single.target_hidden_states,
            loss_mask,
            single.target_last_hidden_states,
            position_ids,
            SEQ_LENS,
            doc_remaining,
        ).loss.backward()
        batch = wrapper.generate_shard_batch(
            input_ids, loss_mask, position_ids, SEQ_LENS, doc_remaining, before=text.sliding_window, after=block
        )
        torch.manual_seed(100 + step)
        native(
            input_ids=input_ids,
            target_hidden_states=batch.target_hidden_states,
            loss_mask=loss_mask,
            target_last_hidden_states=batch.target_last_hidden_states,
            position_ids=position_ids,
            seq_lens=SEQ_LENS,
            doc_remaining=doc_remaining,
            shard=batch.shard,
        ).loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    native_params, trained = dict(native.named_parameters()), 0
    for name, expected in reference.named_parameters():
        ours = native_params.get(name) if strategy == "fsdp2" else native_params.get(f"module.{name}")
        ours = ours.full_tensor() if hasattr(ours, "full_tensor") else ours.detach()
        peers = [torch.empty_like(ours) for _ in range(size)]
        dist.all_gather(peers, ours.contiguous())
        for peer in peers[1:]:
            assert torch.equal(peer, peers[0]), f"{name} differs across CP peers"
        trained += not torch.equal(expected.detach(), initial[name])
        torch.testing.assert_close(
            ours, expected.detach(), atol=1e-5, rtol=1e-4, msg=lambda text, name=name: f"{name} after 3 steps: {text}"
        )
    assert trained > 10, f"only {trained} parameters changed in 3 steps"


if __name__ == "__main__":
    main()
    from gloo_exit import finish

    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
