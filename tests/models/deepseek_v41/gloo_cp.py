"""Worker for two-rank gloo CP tests (launched by tests/conftest.run_gloo).

Both ranks form one CP group of size 2, hold the same packed batch, and compare the
gathered CP=2 captures (and a first draft step's loss on them) against CP=1 on the same rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options

SEQ_LENS = torch.tensor([[5, 0, 11, 10, 0], [9, 3, 14, -1000, 0]])
SEQUENCE = 26


def first_step_loss(model, batch, seq_lens, input_ids, loss_mask):
    text = model.config.text_config
    options = released_draft_options(text, num_anchors=8)
    torch.manual_seed(1234)
    draft = DeepseekV41PackedDSparkModel.from_options(options)
    draft.initialize_embeddings_and_head(embed_tokens=model.model.embed_tokens, lm_head=model.lm_head)
    trainer = DSparkTrainerModule(draft)
    torch.manual_seed(99)  # same anchors for both runs
    return trainer(
        input_ids=input_ids,
        target_hidden_states=batch.target_hidden_states,
        loss_mask=loss_mask,
        target_last_hidden_states=batch.target_last_hidden_states,
        position_ids=_positions(seq_lens),
        seq_lens=seq_lens,
        doc_remaining=_remaining(seq_lens),
    ).loss


def _positions(seq_lens):
    return torch.stack([torch.cat([torch.arange(n) for n in row if n > 0]) for row in seq_lens.tolist()])


def _remaining(seq_lens):
    return torch.stack([torch.cat([torch.arange(n - 1, -1, -1) for n in row if n > 0]) for row in seq_lens.tolist()])


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        model = build_tiny_target(seed=0)
        layer_ids = model.config.text_config.dspark_target_layer_ids
        input_ids = torch.randint(4, 500, (2, SEQUENCE), generator=torch.Generator().manual_seed(7))
        loss_mask = torch.ones_like(input_ids)
        single = DeepseekV41DSparkTargetModel(model, layer_ids).generate_batch(
            input_ids, loss_mask, loss_mask, seq_lens=SEQ_LENS
        )
        sharded = DeepseekV41DSparkTargetModel(model, layer_ids, cp_mesh=mesh).generate_batch(
            input_ids, loss_mask, loss_mask, seq_lens=SEQ_LENS
        )
        torch.testing.assert_close(sharded.target_hidden_states, single.target_hidden_states, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            sharded.target_last_hidden_states, single.target_last_hidden_states, atol=1e-5, rtol=0
        )
        loss_single = first_step_loss(model, single, SEQ_LENS, input_ids, loss_mask)
        loss_sharded = first_step_loss(model, sharded, SEQ_LENS, input_ids, loss_mask)
        torch.testing.assert_close(loss_sharded, loss_single, atol=1e-5, rtol=1e-5)
        try:
            DeepseekV41DSparkTargetModel(model, layer_ids, cp_mesh=mesh).generate_batch(input_ids, loss_mask, loss_mask)
        except ValueError as error:
            assert "packed batches" in str(error)
        else:
            raise AssertionError("unpacked CP capture must be refused")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from gloo_exit import finish

    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
