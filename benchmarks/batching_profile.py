"""Where a step's time goes, per batching: the recipe's micro-batches of a mix through one step's phases.

Run: ``.venv/bin/python benchmarks/batching_profile.py [--mix demo] [--steps 30]``

For each of the four batchings at ``make compare``'s token budget (``packing_value.shape``), ``--steps``
micro-batches of the recipe's own loader (after one warm-up step) go through the recipe's per-micro-batch work
on the demo target, one thread, timed by phase:

- **capture**: the frozen target's forward (``DeepseekV41DSparkTargetModel.generate_batch``);
- **draft**: the draft's forward and the DSpark loss (``PackedDSparkTrainerModule``);
- **backward + AdamW**: backward, gradient clipping and the optimizer step.

Counted a step: captured tokens, real tokens, and the anchor blocks the draft runs (``anchors``) of which kept
(``kept``: real anchors; the rest are dummies the draft computes and the loss masks). Upstream's unpacked path
samples a fixed ``num_anchors`` a row, dummies included (``sample_anchor_positions``); packed, ``dynamic`` and
``grouped`` rows size the anchors by the real candidates (``anchors.compact_anchors``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import packing_value  # noqa: E402


def loader(batching: str, shape, path: Path, tokenizer):
    """The recipe's training loader of ``batching`` (``TrainPackedDSparkV41Recipe._build_dataloader``'s choice)."""
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_dataloader

    from nemo_automodel_ext.run.batching import build_token_budget_dataloader

    if batching in ("dynamic", "grouped"):
        return build_token_budget_dataloader(
            data_path=str(path),
            tokenizer=tokenizer,
            seq_length=shape.seq_length,
            budget=shape.seq_length * shape.micro_batch_size,
            grouped=batching == "grouped",
            shuffle=True,
            shuffle_seed=42,
            epochs=1,
        )
    return build_eagle3_dataloader(
        data_path=str(path),
        tokenizer=tokenizer,
        seq_length=shape.seq_length,
        batch_size=shape.micro_batch_size,
        shuffle=True,
        num_workers=0,
        shuffle_seed=42,
        packed_sequence_size=shape.packed_sequence_size,
    )


class Step:
    """The recipe's per-micro-batch work on the demo target and a fresh draft, timed by phase."""

    def __init__(self, num_anchors: int = 48):
        from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

        from nemo_automodel_ext.demo.demo_target import load_demo_target
        from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
        from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
        from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
        from nemo_automodel_ext.models.deepseek_v41.tiny import released_draft_options

        target = load_demo_target()
        text = target.config.text_config
        self.wrapper = DeepseekV41DSparkTargetModel(target, text.dspark_target_layer_ids)
        torch.manual_seed(0)
        draft = DeepseekV41PackedDSparkModel.from_options(
            released_draft_options(text, num_anchors=num_anchors), anchors_per_document=num_anchors
        )
        draft.initialize_embeddings_and_head(
            embed_tokens=target.model.embed_tokens, lm_head=target.lm_head, freeze=True
        )
        self.draft = draft
        self.trainer = PackedDSparkTrainerModule(draft, loss_decay_gamma=2.0, ce_loss_alpha=1.0, l1_loss_alpha=0.1)
        self.optimizer = torch.optim.AdamW([p for p in self.trainer.parameters() if p.requires_grad], lr=1e-3)
        self.clip = scale_grads_and_clip_grad_norm

    def __call__(self, batch: dict) -> dict:
        packing = {key: batch.get(key) for key in ("position_ids", "seq_lens", "doc_remaining")}
        loss_mask = batch["loss_mask"]
        state = torch.get_rng_state()
        anchors, keep = self.draft.sample_anchors(loss_mask, packing["seq_lens"], packing["doc_remaining"])
        torch.set_rng_state(state)  # the trainer draws the same anchors
        times = {}
        start = time.perf_counter()
        with torch.no_grad():
            captured = self.wrapper.generate_batch(batch["input_ids"], batch["attention_mask"], loss_mask, **packing)
        times["capture"] = time.perf_counter() - start
        start = time.perf_counter()
        metrics = self.trainer(
            batch["input_ids"],
            captured.target_hidden_states,
            loss_mask,
            captured.target_last_hidden_states,
            packing["position_ids"],
            packing["seq_lens"],
            packing["doc_remaining"],
        )
        times["draft"] = time.perf_counter() - start
        start = time.perf_counter()
        metrics.loss.backward()
        self.clip(1.0, [self.trainer])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        times["backward"] = time.perf_counter() - start
        return {
            **times,
            "captured": batch["input_ids"].numel(),
            "real": int(batch["attention_mask"].sum()),
            "anchors": anchors.numel(),
            "kept": int(keep.sum()),
        }


def profile(mix: str, steps: int) -> None:
    from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer

    torch.set_num_threads(1)
    data = packing_value.mix_data(mix)
    counted = packing_value.lengths(data["train"])
    longest = 8 * -(-max(counted + packing_value.lengths(data["test"]) + packing_value.lengths(data["dev"])) // 8)
    tokenizer = build_tokenizer()
    step = Step()
    print(
        f"\n{mix} mix, {packing_value.MIXES[mix].row * packing_value.MIXES[mix].rows:,} tokens a micro-batch, "
        f"{steps} steps each, one thread: milliseconds a step by phase\n"
    )
    print(
        "| batching | rows x width | capture | draft fwd + loss | backward + AdamW | total | ms / 1k captured "
        "| captured | real | anchor blocks | kept |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batching in packing_value.BATCHINGS:
        shape = packing_value.shape(batching, packing_value.MIXES[mix], counted, longest)
        batches = iter(loader(batching, shape, data["train"], tokenizer))
        step(next(batches))  # warm-up
        rows = [step(next(batches)) for _ in range(steps)]
        mean = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
        total = mean["capture"] + mean["draft"] + mean["backward"]
        first = next(iter(loader(batching, shape, data["train"], tokenizer)))["input_ids"].shape
        print(
            f"| {batching} | {first[0]} x {first[1]} | {1000 * mean['capture']:.0f} | {1000 * mean['draft']:.0f} | "
            f"{1000 * mean['backward']:.0f} | {1000 * total:.0f} | {1e6 * total / mean['captured']:.0f} | "
            f"{mean['captured']:,.0f} | {mean['real']:,.0f} | {mean['anchors']:,.0f} | {mean['kept']:,.0f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", default="demo", choices=sorted(packing_value.MIXES))
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    profile(options.mix, options.steps)


if __name__ == "__main__":
    main()
