"""The demo target and a briefly trained draft: a pair whose acceptance is far from trivial (shared by tests)."""

from __future__ import annotations

import random

import torch
from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule

from nemo_automodel_ext.demo.demo_target import load_demo_target
from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, conversation
from nemo_automodel_ext.evaluation.sequences import EvalSequence, encode_conversation, pack_sequences
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import released_draft_options

TRAIN_STEPS = 120


def demo_sequences(count: int, seed: int) -> list[EvalSequence]:
    tokenizer = build_tokenizer()
    rng = random.Random(seed)
    encoded = [encode_conversation(tokenizer, conversation(rng)["messages"]) for _ in range(count)]
    return [EvalSequence(tuple(full[:prompt]), tuple(full[prompt:])) for full, prompt in encoded]


def draft_options(text, num_anchors=24):
    return released_draft_options(text, num_anchors, confidence_head_alpha=0.1)


def build_demo_pair():
    """(target wrapper, trained draft, untrained draft, tokenizer) on the shipped demo target."""
    target = load_demo_target()
    text = target.config.text_config
    wrapper = DeepseekV41DSparkTargetModel(target, text.dspark_target_layer_ids)
    torch.manual_seed(0)
    untrained = DeepseekV41PackedDSparkModel.from_options(draft_options(text))
    untrained.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    draft = DeepseekV41PackedDSparkModel.from_options(draft_options(text))
    draft.load_state_dict(untrained.state_dict())
    draft.set_embedding_head_trainable(False)
    trainer = DSparkTrainerModule(draft, ce_loss_alpha=0.5, l1_loss_alpha=0.5, confidence_head_alpha=0.1)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=5e-3)
    batches = pack_sequences(demo_sequences(TRAIN_STEPS * 12, seed=1), 128, 4, build_tokenizer().pad_token_id)
    for batch in batches[:TRAIN_STEPS]:
        capture = wrapper.generate_batch(
            batch["input_ids"],
            batch["attention_mask"],
            batch["loss_mask"],
            position_ids=batch["position_ids"],
            seq_lens=batch["seq_lens"],
            doc_remaining=batch["doc_remaining"],
        )
        metrics = trainer(
            input_ids=batch["input_ids"],
            target_hidden_states=capture.target_hidden_states,
            loss_mask=batch["loss_mask"],
            target_last_hidden_states=capture.target_last_hidden_states,
            position_ids=batch["position_ids"],
            seq_lens=batch["seq_lens"],
            doc_remaining=batch["doc_remaining"],
        )
        metrics.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return wrapper, draft.eval(), untrained.eval(), build_tokenizer()
