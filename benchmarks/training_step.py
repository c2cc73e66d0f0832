"""Full DSpark training steps on CPU: packed vs padded, cost per token vs pack size, host syncs.

Run: ``.venv/bin/python benchmarks/training_step.py [--documents 128] [--skip padded scaling syncs]``

A step is what the recipe's loop runs per micro-batch: the frozen target's capture, the draft's
forward, the DSpark loss, backward, gradient clipping and an AdamW step. Documents are drawn
from a skewed chat-length mix (lognormal, median 200 tokens, sigma 1.0, 16..2048 tokens), all
supervised, ``--per-document`` anchors each (the packed budget; padded rows get the same
count per row, one document a row).

1. Packed vs padded, real tokens per second over the same documents, for the tiny config and a
   mid-size one (hidden 256, 4 heads x 64, 8 experts of 128; 6 layers). Padded: micro-batches
   of 8 documents padded to the longest. Packed: rows of ``--row`` tokens. Goal: packed >= 2x.
2. Cost per real token as the pack grows (rows of 1k, 4k, 16k, 32k tokens, the tiny config), per
   part: the plugin's layout (align, pack the ids, restore the features), the draft step on
   captured-shape features (forward, loss, backward, AdamW), and upstream's eager CPU target
   forward (measured up to ``--target-max-row``: its CPU attention grows quadratically with the row,
   150 s and 19 GB for one 16k row on 2 cores; TileLang on GPU does not). Goal: flat within 1.5x.
3. Host syncs of one packed step (``host_syncs.py``), by call site and owner. Goal: at most 3 in
   the plugin's own code outside logging steps (CP's are in ``cp_draft.py``'s table).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MID = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
}


def chat_lengths(count: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randn(count, generator=generator).mul(1.0).add(math.log(200)).exp()
    return [int(n) for n in draws.clamp(16, 2048).round().tolist()]


class Stepper:
    """The recipe's per-micro-batch work on one config."""

    def __init__(self, overrides: dict, per_document: int):
        from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
        from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
        from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
        from nemo_automodel_ext.models.deepseek_v41.tiny import (
            build_tiny_target,
            released_draft_options,
            tiny_target_config,
        )

        config = tiny_target_config(**overrides)
        self.target = build_tiny_target(config=config)
        text = config.text_config
        self.vocab = text.vocab_size
        self.wrapper = DeepseekV41DSparkTargetModel(self.target, text.dspark_target_layer_ids)
        torch.manual_seed(0)
        draft = DeepseekV41PackedDSparkModel.from_options(
            released_draft_options(text, num_anchors=per_document), anchors_per_document=per_document
        )
        draft.initialize_embeddings_and_head(
            embed_tokens=self.target.model.embed_tokens, lm_head=self.target.lm_head, freeze=True
        )
        self.trainer = PackedDSparkTrainerModule(draft, loss_decay_gamma=2.0, ce_loss_alpha=1.0, l1_loss_alpha=0.1)
        self.optimizer = torch.optim.AdamW([p for p in self.trainer.parameters() if p.requires_grad], lr=1e-4)

    def step(self, input_ids, attention_mask, seq_lens=None) -> None:
        self.timed(*self.prepare(input_ids, attention_mask, seq_lens))

    def prepare(self, input_ids, attention_mask, seq_lens=None) -> tuple:
        """The step's inputs: the data loader's packing tensors (built on the host, not a step cost)."""
        from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

        loss_mask = attention_mask.long()
        packing = {}
        if seq_lens is not None:
            rows = [[n for n in row if n > 0] for row in seq_lens.tolist()]
            packing = {
                "position_ids": torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]),
                "seq_lens": seq_lens,
                "doc_remaining": torch.stack([torch.cat([torch.arange(n - 1, -1, -1) for n in row]) for row in rows]),
            }
        return input_ids, attention_mask, loss_mask, packing, scale_grads_and_clip_grad_norm

    def timed(self, input_ids, attention_mask, loss_mask, packing, clip) -> None:
        captured = self.wrapper.generate_batch(input_ids, attention_mask, loss_mask, **packing)
        metrics = self.trainer(
            input_ids,
            captured.target_hidden_states,
            loss_mask,
            captured.target_last_hidden_states,
            packing.get("position_ids"),
            packing.get("seq_lens"),
            packing.get("doc_remaining"),
        )
        metrics.loss.backward()
        clip(1.0, [self.trainer])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def tokens(self, lengths: list[int]) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        return [torch.randint(4, self.vocab - 16, (n,), generator=generator) for n in lengths]


def padded_batches(documents: list[torch.Tensor], rows: int = 8):
    for start in range(0, len(documents), rows):
        group = documents[start : start + rows]
        width = max(len(d) for d in group)
        ids = torch.full((len(group), width), 2)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, document in enumerate(group):
            ids[i, : len(document)] = document
            mask[i, : len(document)] = 1
        yield ids, mask, None


def packed_batches(documents: list[torch.Tensor], row: int):
    """One-row batches of ``row`` tokens: documents in order, the tail padding a document of its own."""
    current, lengths = [], []
    for document in documents:
        document = document[:row]
        if sum(lengths) + len(document) > row:
            yield _packed_row(current, lengths, row)
            current, lengths = [], []
        current.append(document)
        lengths.append(len(document))
    if current:
        yield _packed_row(current, lengths, row)


def _packed_row(current, lengths, row):
    tail = row - sum(lengths)
    ids = torch.cat([*current, torch.full((tail,), 2)]).unsqueeze(0)
    mask = torch.cat([torch.ones(row - tail, dtype=torch.long), torch.zeros(tail, dtype=torch.long)]).unsqueeze(0)
    return ids, mask, torch.tensor([lengths + ([tail] if tail else [])])


def run(stepper: Stepper, batches) -> tuple[float, int]:
    batches = list(batches)
    stepper.step(*batches[0])  # warm-up (kernels, allocator)
    start, tokens = time.perf_counter(), 0
    for ids, mask, seq_lens in batches:
        stepper.step(ids, mask, seq_lens)
        tokens += int(mask.sum())
    return time.perf_counter() - start, tokens


def scaling(args) -> None:
    """Section 2: microseconds per real token of each part of a packed step, by row length."""
    from nemo_automodel_ext.models.deepseek_v41.dspark_target import aligned_packed_layout

    print("\n2. cost per real token as the pack grows (tiny config), microseconds per token (vs the 1k row)")
    print(f"{'row':>7} {'layout':>14} {'draft step':>14} {'target (eager)':>16}")
    stepper = Stepper({}, args.per_document)
    text = stepper.target.config.text_config
    feature_width = len(text.dspark_target_layer_ids) * text.hidden_size
    many = stepper.tokens(chat_lengths(2400, seed=2))
    base: list[float] = []
    for row in (1024, 4096, 16384, 32768):
        ids, mask, seq_lens = next(packed_batches(many, row))
        input_ids, attention_mask, loss_mask, packing, clip = stepper.prepare(ids, mask, seq_lens)
        tokens = int(mask.sum())
        features = torch.randn(1, row, feature_width)
        last = torch.randn(1, row, text.hidden_size)

        def layout():
            plan = aligned_packed_layout(seq_lens, (1, row), 4, sync_across_ranks=False)
            plan.pack(input_ids)
            return plan.restore(torch.zeros(1, plan.source_indices.shape[1], feature_width))

        def draft():
            metrics = stepper.trainer(
                input_ids, features, loss_mask, last, packing["position_ids"], seq_lens, packing["doc_remaining"]
            )
            metrics.loss.backward()
            clip(1.0, [stepper.trainer])
            stepper.optimizer.step()
            stepper.optimizer.zero_grad(set_to_none=True)

        costs = [_per_token(layout, tokens), _per_token(draft, tokens)]
        if row <= args.target_max_row:
            costs.append(
                _per_token(
                    lambda: stepper.wrapper.generate_batch(input_ids, attention_mask, loss_mask, **packing), tokens
                )
            )
        base = base or costs
        cells = [f"{c:>7.2f} ({c / b:.2f}x)" for c, b in zip(costs, base)]
        cells += ["skipped"] * (3 - len(cells))
        print(f"{row:>7} {cells[0]:>14} {cells[1]:>14} {cells[2]:>16}")


def _per_token(fn, tokens: int, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=128)
    parser.add_argument("--row", type=int, default=2048, help="packed row of section 1 (the longest document)")
    parser.add_argument("--target-max-row", type=int, default=4096)
    parser.add_argument("--per-document", type=int, default=16)
    parser.add_argument("--skip", nargs="*", default=[], choices=["padded", "scaling", "syncs"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    lengths = chat_lengths(args.documents)
    print(
        f"{len(lengths)} documents, lengths median {sorted(lengths)[len(lengths) // 2]}, mean "
        f"{sum(lengths) / len(lengths):.0f}, max {max(lengths)}; {args.per_document} anchors a document; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    if "padded" not in args.skip:
        print(f"\n1. packed ({args.row}-token rows) vs padded (8 documents a micro-batch), real tokens/s")
        print(f"{'config':<8} {'padded tok/s':>13} {'packed tok/s':>13} {'packed/padded':>14}")
        for name, overrides in (("tiny", {}), ("mid", MID)):
            stepper = Stepper(overrides, args.per_document)
            documents = stepper.tokens(lengths)
            padded_seconds, padded_tokens = run(stepper, padded_batches(documents))
            packed_seconds, packed_tokens = run(stepper, packed_batches(documents, args.row))
            padded, packed = padded_tokens / padded_seconds, packed_tokens / packed_seconds
            print(f"{name:<8} {padded:>13,.0f} {packed:>13,.0f} {packed / padded:>13.2f}x")
    if "scaling" not in args.skip:
        scaling(args)
    if "syncs" not in args.skip:
        from host_syncs import by_owner, count_host_syncs, owner

        print("\n3. host syncs of one packed training step (tiny config, 4096-token row), by call site")
        stepper = Stepper({}, args.per_document)
        batch = next(packed_batches(stepper.tokens(lengths), args.row))
        prepared = stepper.prepare(*batch)
        stepper.timed(*prepared)
        with count_host_syncs() as counts:
            stepper.timed(*prepared)
        for site, count in sorted(counts.items(), key=lambda item: -item[1]):
            print(f"  {count:>4}  {site:<48} {owner(site)}")
        print("  by owner: " + ", ".join(f"{name} {count}" for name, count in by_owner(counts).items()))
        print(
            "  plus upstream's loop per micro-batch: _DSparkMetricWindow.add reads 10 scalars (.item()), and the "
            "recipe's counters read one all-reduced tensor (tokens, checksum, non-finite flag)"
        )


if __name__ == "__main__":
    main()
