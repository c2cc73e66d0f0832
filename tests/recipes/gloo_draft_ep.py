"""Worker for the draft expert-parallelism test (four gloo ranks, launched by tests/conftest.run_gloo).

Every rank builds the same tiny target and draft. The reference is the draft alone: the mean
loss of the micro-batches of every dp group, one backward, upstream's clip. Then, for each
layout (EP 1, EP 2, EP 4 over four dp ranks; EP 2 over dp 2 x CP 2; the all-to-all dispatcher, and
upstream's all-gather one for EP 4 and EP 2 x CP 2; some with the recipe's activation checkpointing, applied
by ``parallelize_draft`` after expert parallelism, the MoE blocks included), the recipe's ``parallelize_draft``
(FSDP2, experts on ``expert_mesh``) trains its micro-batch (under CP its shard of it) and must give:

- the reference loss (mean over ranks) and every gradient (``full_tensor``), and the same
  clipped norm from upstream's ``scale_grads_and_clip_grad_norm`` (what the recipe's loop calls);
- the same state-dict keys as the reference (native and released names), each rank holding
  experts / EP of every layer;
- after an SGD step, the reference's parameters; an AdamW step (the recipe's optimizer) runs.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from dspark_checks import packing_tensors
from gloo_exit import finish
from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options
from nemo_automodel_ext.recipes.parallel import draft_mesh, expert_mesh, parallelize_draft

SEQ_LENS = torch.tensor([[5, 0, 17, 18, 0], [9, 3, 28, -1000, 0]])
SEQUENCE = 40
ANCHORS = 64
# (draft EP, CP, dispatcher, activation checkpointing as the recipe applies it) over four ranks
LAYOUTS = (
    (1, 1, "all_to_all", True),
    (2, 1, "all_to_all", True),
    (4, 1, "all_to_all", False),
    (2, 2, "all_to_all", True),
    (4, 1, "all_to_all", True),
    (4, 1, "all_gather", False),
    (2, 2, "all_gather", True),
)


def unwrapped(name: str) -> str:
    """A parameter name without the activation-checkpoint wrapper's module level."""
    return name.replace("._checkpoint_wrapped_module", "")


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    world = dist.get_world_size()
    model = build_tiny_target(seed=0)
    text = model.config.text_config
    position_ids, doc_remaining, loss_mask = packing_tensors(SEQ_LENS)
    torch.manual_seed(1234)
    # A budget above every document's supervised tokens: every anchor is drawn, no random choice.
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=ANCHORS), anchors_per_document=ANCHORS
    )
    draft.initialize_embeddings_and_head(embed_tokens=model.model.embed_tokens, lm_head=model.lm_head)
    experts, block = draft.config.dspark_n_routed_experts, text.dspark_block_size
    released_keys = sorted(draft.state_dict_adapter.to_hf(draft.state_dict()))

    for ep, cp, dispatcher, checkpointed in LAYOUTS:
        dp = world // cp
        # The dp groups' micro-batches as rows of one batch: upstream's loss normalises by the
        # world-wide denominator, so the reference is one step on all of them (every anchor drawn).
        seq_lens, positions, remaining, mask = (
            t.repeat(dp, 1) for t in (SEQ_LENS, position_ids, doc_remaining, loss_mask)
        )
        ids = torch.randint(4, 500, (2 * dp, SEQUENCE), generator=torch.Generator().manual_seed(dp))
        single = DeepseekV41DSparkTargetModel(model, text.dspark_target_layer_ids)
        capture = single.generate_batch(ids, torch.ones_like(ids), mask, positions, seq_lens, remaining)
        reference = PackedDSparkTrainerModule(copy.deepcopy(draft), loss_decay_gamma=2.0)
        expected_loss = reference(
            ids, capture.target_hidden_states, mask, capture.target_last_hidden_states, positions, seq_lens, remaining
        ).loss
        expected_loss.backward()
        expected_norm = scale_grads_and_clip_grad_norm(1.0, [reference])

        device_mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp")) if cp > 1 else None
        module = PackedDSparkTrainerModule(copy.deepcopy(draft), loss_decay_gamma=2.0)
        native = parallelize_draft(
            module,
            "fsdp2",
            world,
            torch.device("cpu"),
            draft_mesh(device_mesh),
            torch.float32,
            experts=expert_mesh("cpu", world, ep) if ep > 1 else None,
            dispatcher=dispatcher,
            activation_checkpointing=checkpointed,
        )
        if checkpointed:  # every layer's MoE block is checkpointed, under EP too
            assert all(type(layer.ffn).__name__ == "CheckpointWrapper" for layer in native.draft_model.layers), ep
        d = device_mesh["dp"].get_local_rank() if cp > 1 else dist.get_rank()
        rows = slice(2 * d, 2 * d + 2)
        if cp > 1:
            wrapper = DeepseekV41DSparkTargetModel(model, text.dspark_target_layer_ids, cp_mesh=device_mesh["cp"])
            batch = wrapper.generate_shard_batch(
                ids[rows], loss_mask, position_ids, SEQ_LENS, doc_remaining, before=text.sliding_window, after=block
            )
            features, teacher, where = batch.target_hidden_states, batch.target_last_hidden_states, batch.shard
        else:
            features, teacher = capture.target_hidden_states[rows], capture.target_last_hidden_states[rows]
            where = None
        loss = native(
            input_ids=ids[rows],
            target_hidden_states=features,
            loss_mask=loss_mask,
            target_last_hidden_states=teacher,
            position_ids=position_ids,
            seq_lens=SEQ_LENS,
            doc_remaining=doc_remaining,
            shard=where,
        ).loss
        loss.backward()
        norm = scale_grads_and_clip_grad_norm(1.0, [native])
        label = f"EP {ep} x CP {cp} ({dispatcher}{', checkpointed' if checkpointed else ''})"

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(mean_loss / world, expected_loss.detach(), atol=1e-6, rtol=1e-5, msg=label)
        ours = {unwrapped(name): param for name, param in native.named_parameters()}
        assert sorted(ours) == sorted(dict(reference.named_parameters())), label
        assert sorted(map(unwrapped, native.state_dict())) == sorted(reference.state_dict()), label
        compared = 0
        for name, theirs in reference.named_parameters():
            grad = ours[name].grad
            if theirs.grad is None:
                assert grad is None or not grad.full_tensor().any(), (label, name)
                continue
            torch.testing.assert_close(
                grad.full_tensor(), theirs.grad, atol=2e-6, rtol=1e-4, msg=lambda m, n=name: f"{label} {n}: {m}"
            )
            compared += 1
        assert compared > 10, compared
        torch.testing.assert_close(
            torch.as_tensor(norm).float(), torch.as_tensor(expected_norm).float(), rtol=1e-5, atol=1e-7, msg=label
        )
        for layer in native.draft_model.layers if ep > 1 else ():
            local = layer.mlp.experts.gate_and_up_projs.to_local()
            assert local.shape[0] == experts // ep, (label, local.shape)

        # One SGD step equals the reference's (the clipped gradients above); the recipe's AdamW steps too.
        for module in (reference, native):
            torch.optim.SGD(module.parameters(), lr=0.5).step()
        for name, theirs in reference.named_parameters():
            torch.testing.assert_close(ours[name].full_tensor(), theirs.detach(), atol=1e-6, rtol=1e-5, msg=name)
        torch.optim.AdamW(native.parameters(), lr=1e-3).step()
        if ep > 1:
            exported = native.draft_model.state_dict_adapter.to_hf(native.draft_model.state_dict())
            gathered = [None] * world
            dist.all_gather_object(gathered, sorted(exported))
            assert sorted({key for keys in gathered for key in keys}) == released_keys, label
        if dist.get_rank() == 0:
            print(
                f"{label}: loss {float(mean_loss) / world:.6f}, "
                f"{compared} gradients equal, {experts // ep} experts a rank"
            )
    dist.barrier()


if __name__ == "__main__":
    main()
    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
