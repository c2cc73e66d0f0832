"""How the recipe batches its conversations: ``recipe_args.batching``.

- ``packed`` (``packed_sequence_size > 0``): upstream's greedy packing into fixed rows, every document
  on a compression-group boundary in the capture (``dspark_target.py``);
- ``upstream`` (``packed_sequence_size: 0``): upstream's unpacked path, every conversation its own row
  padded to ``seq_length`` (what a user of upstream's recipe gets);
- ``dynamic``: one conversation a row, micro-batches filled to a token budget
  (``recipe_args.tokens_per_micro_batch``, default ``seq_length x micro_batch_size``: a packed
  micro-batch's tokens) and padded to the batch's longest conversation;
- ``grouped``: ``dynamic`` over a length-grouped order (transformers' ``LengthGroupedSampler``:
  a random permutation sorted by length within mega-batches), so a batch holds conversations of
  similar length and pads little.

``dynamic`` and ``grouped`` rows are laid out as upstream's packing lays out a row of one document
(``build_packed_eagle3_dataset``: trailing padding folded into the document, ``doc_remaining``
masking supervision into it), so they run the same capture and draft code as packed rows: the
comparison of batchings measures the batching, not two code paths (a fair baseline is not a slow one).

Held-out prompts are batched alike whatever the training batching (``build_recipe_dataloader``): packed in
order into rows of ``evaluation_row_width`` (the packed row, else ``seq_length``), as the evaluator CLI packs them,
so every batching's draft is scored on the same layout, and upstream's padding (one conversation a row of
``seq_length``) never multiplies the cost of an evaluation.

``TokenBudgetBatchSampler`` gives every conversation exactly once an epoch, the same number of
micro-batches in every epoch and on every data-parallel rank (batches are split, never merged, to
reach it), and a deterministic order per ``(seed, epoch)``, so a resumed run continues an epoch
exactly where its checkpoint left it (``recipes/resume.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

BATCHINGS = ("packed", "upstream", "dynamic", "grouped")


def resolve_batching(args: dict[str, Any]) -> str:
    """``recipe_args.batching``, or the one ``packed_sequence_size`` implies when unset (packed / upstream)."""
    batching = args.get("batching")
    if batching is None:
        return "packed" if int(args.get("packed_sequence_size") or 0) > 0 else "upstream"
    return str(batching)


def token_budget(args: dict[str, Any]) -> int:
    """Padded tokens a ``dynamic``/``grouped`` micro-batch may hold: ``tokens_per_micro_batch`` or
    ``seq_length x micro_batch_size`` (a packed micro-batch's tokens)."""
    budget = args.get("tokens_per_micro_batch")
    return int(budget) if budget is not None else int(args["seq_length"]) * int(args["micro_batch_size"])


def evaluation_row_width(args: dict[str, Any]) -> int:
    """Columns of a row held-out prompts are packed into for acceptance, whatever ``recipe_args.batching``: the
    packed row (``packed_sequence_size``), else ``seq_length`` (a conversation's most tokens)."""
    return int(args["packed_sequence_size"] or args["seq_length"])


def fill_to_budget(order: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive runs of ``order`` as batches whose count x longest length stays within ``budget``.

    Args:
        order: Document indices in the order to batch them.
        lengths: Tokens of each document (index into it with ``order``'s entries).
        budget: Padded tokens a batch may hold; a document longer than it is a batch of its own.

    Returns:
        New lists of indices, every entry of ``order`` exactly once, in order.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        length = int(lengths[index])
        if current and (len(current) + 1) * max(longest, length) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(int(index))
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def split_to_count(batches: list[list[int]], count: int) -> list[list[int]]:
    """Split the batches holding the most documents in two (in place in the order) until there are ``count``.

    Raises:
        ValueError: when ``count`` is below the batches given, or every batch is down to one document.
    """
    if count < len(batches):
        raise ValueError(f"cannot make {len(batches)} batches into {count} without merging")
    batches = [list(batch) for batch in batches]
    while len(batches) < count:
        widest = max(range(len(batches)), key=lambda i: (len(batches[i]), -i))
        if len(batches[widest]) < 2:
            raise ValueError(
                f"{sum(map(len, batches))} documents cannot make {count} micro-batches (one document each at most); "
                "use fewer data-parallel ranks or more data"
            )
        half = len(batches[widest]) // 2
        batches[widest : widest + 1] = [batches[widest][:half], batches[widest][half:]]
    return batches


class TokenBudgetBatchSampler:
    """Micro-batches of document indices within a token budget, the same count every epoch and rank.

    Args:
        lengths: Tokens of each document (after truncation).
        budget: Padded tokens a micro-batch may hold (count x its longest document).
        grouped: Length-grouped order (``LengthGroupedSampler``) instead of a uniform permutation.
        shuffle: Reorder every epoch; False keeps the dataset's order (validation).
        seed: Order seed; epoch ``e`` uses ``seed + e``.
        epochs: Epochs the run trains; the per-epoch count is the largest any of them needs.
        num_replicas: Data-parallel ranks sharing the epoch (each takes every ``num_replicas``-th batch).
        rank: This rank among them.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        budget: int,
        *,
        grouped: bool,
        shuffle: bool,
        seed: int,
        epochs: int,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not lengths:
            raise ValueError("no documents to batch")
        if budget < 1 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"budget {budget}, num_replicas {num_replicas} and rank {rank} cannot batch")
        self.lengths = [int(length) for length in lengths]
        self.budget, self.grouped, self.shuffle = int(budget), bool(grouped), bool(shuffle)
        self.seed, self.num_replicas, self.rank = int(seed), int(num_replicas), int(rank)
        self.epoch = 0
        natural = max(len(self._natural(epoch)) for epoch in range(max(1, int(epochs)) if shuffle else 1))
        self.count = -(-natural // self.num_replicas) * self.num_replicas  # per epoch, all ranks
        self.epoch_batches(0)  # refuses now (too few documents) rather than mid-run

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.lengths)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        if not self.grouped:
            return torch.randperm(len(self.lengths), generator=generator).tolist()
        from transformers.trainer_pt_utils import LengthGroupedSampler

        typical = sorted(self.lengths)[len(self.lengths) // 2]
        per_batch = max(1, self.budget // max(1, typical))  # documents of a typical batch
        return list(LengthGroupedSampler(per_batch, lengths=self.lengths, generator=generator))

    def _natural(self, epoch: int) -> list[list[int]]:
        return fill_to_budget(self._order(epoch), self.lengths, self.budget)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches of ``epoch`` (``count`` of them; rank r takes r, r + replicas, ...)."""
        return split_to_count(self._natural(epoch), self.count)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.count // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.epoch_batches(self.epoch)[self.rank :: self.num_replicas])


def one_document_rows(features: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Collate documents into rows of one document each, padded to the longest, in upstream's packed row layout.

    Args:
        features: ``ChatDataset`` samples (``input_ids``, ``loss_mask``), unpadded.
        pad_token_id: Token filling each row after its document.

    Returns:
        New int64 tensors ``input_ids``, ``loss_mask``, ``attention_mask``, ``position_ids``, ``doc_remaining``
        [batch, longest] and ``seq_lens`` [batch, 1] (each row's width: its document with the padding folded in,
        as ``build_packed_eagle3_dataset`` lays out a row).
    """
    from nemo_automodel.components.datasets.llm.eagle3 import build_packed_eagle3_dataset

    width = max(len(feature["input_ids"]) for feature in features)
    rows = [
        build_packed_eagle3_dataset([feature], packed_sequence_size=width, pad_token_id=pad_token_id)[0]
        for feature in features
    ]
    return {
        key: torch.tensor([row[key] for row in rows], dtype=torch.long)
        for key in ("input_ids", "loss_mask", "attention_mask", "position_ids", "doc_remaining", "seq_lens")
    }


def build_token_budget_dataloader(
    *,
    data_path: str,
    tokenizer,
    seq_length: int,
    budget: int,
    grouped: bool,
    shuffle: bool,
    shuffle_seed: int,
    epochs: int,
    split: str | None = None,
    mask_reasoning_content: bool = False,
    mask_generation_prompt: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
    num_workers: int = 0,
) -> DataLoader:
    """A ``dynamic`` (or, with ``grouped``, ``grouped``) loader: upstream's ``ChatDataset`` (unpadded, truncated to
    ``seq_length``) batched by ``TokenBudgetBatchSampler`` and collated by ``one_document_rows``.

    Returns:
        A DataLoader whose ``batch_sampler`` has ``set_epoch`` (the recipe's loop calls it every epoch).
    """
    from nemo_automodel.components.datasets.llm.chat_dataset import ChatDataset

    dataset = ChatDataset(
        data_path,
        tokenizer=tokenizer,
        split=split,
        seq_length=seq_length,
        padding="do_not_pad",
        truncation=True,
        shuffle_seed=shuffle_seed,
        unshifted=True,
        mask_reasoning_content=mask_reasoning_content,
        mask_generation_prompt=mask_generation_prompt,
    )
    # Tokenised once: the lengths order the batches, and the samples are what the batches hold (upstream's packed
    # path also keeps its rows in memory).
    samples = [dataset[index] for index in range(len(dataset))]
    sampler = TokenBudgetBatchSampler(
        [len(sample["input_ids"]) for sample in samples],
        budget,
        grouped=grouped,
        shuffle=shuffle,
        seed=shuffle_seed,
        epochs=epochs,
        num_replicas=num_replicas,
        rank=rank,
    )
    return DataLoader(
        samples,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=functools.partial(one_document_rows, pad_token_id=dataset.pad_token_id),
    )


def build_recipe_dataloader(
    args: dict[str, Any], tokenizer, path: str, split: str | None, train: bool, dp_mesh=None
) -> DataLoader:
    """The recipe's loader of ``path``: for training, the batching ``recipe_args.batching`` names (upstream's packed
    or padded loader, or ``build_token_budget_dataloader``); for held-out prompts (``train=False``), upstream's
    packed loader in order at ``evaluation_row_width`` for every batching, ``micro_batch_size`` rows a batch.

    Args:
        args: Validated ``recipe_args``.
        dp_mesh: The data-parallel mesh, or None (every rank is a data-parallel rank when distributed).

    Returns:
        A DataLoader of batches in the recipe's format (new tensors per batch): packed rows, or for ``upstream``
        training upstream's rows of one conversation padded to ``seq_length``; each data-parallel rank reads its
        share.
    """
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_dataloader

    distributed = torch.distributed.is_initialized()
    if train and args["batching"] in ("dynamic", "grouped"):
        replicas, rank = 1, 0
        if distributed and dp_mesh is not None:
            replicas, rank = dp_mesh.size(), dp_mesh.get_local_rank()
        elif distributed:
            replicas, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        return build_token_budget_dataloader(
            data_path=path,
            tokenizer=tokenizer,
            seq_length=int(args["seq_length"]),
            budget=token_budget(args),
            grouped=args["batching"] == "grouped",
            shuffle=True,
            shuffle_seed=int(args["shuffle_seed"]),
            epochs=int(args["num_epochs"]),
            split=split,
            mask_reasoning_content=bool(args["mask_reasoning_content"]),
            mask_generation_prompt=bool(args["mask_generation_prompt"]),
            num_replicas=replicas,
            rank=rank,
            num_workers=int(args["num_workers"]),
        )
    return build_eagle3_dataloader(
        data_path=path,
        tokenizer=tokenizer,
        seq_length=int(args["seq_length"]),
        batch_size=int(args["micro_batch_size"]),
        shuffle=train,
        num_workers=int(args["num_workers"]),
        split=split,
        # A DistributedSampler even on one rank: its order depends on (seed, epoch) only, which is what lets a
        # resumed run continue an epoch exactly where the checkpoint left it.
        distributed=distributed,
        shuffle_seed=args["shuffle_seed"],
        mask_reasoning_content=bool(args["mask_reasoning_content"]),
        mask_generation_prompt=bool(args["mask_generation_prompt"]),
        packed_sequence_size=int(args["packed_sequence_size"] or 0) if train else evaluation_row_width(args),
        dp_mesh=dp_mesh,
    )


__all__ = [
    "BATCHINGS",
    "TokenBudgetBatchSampler",
    "build_recipe_dataloader",
    "build_token_budget_dataloader",
    "evaluation_row_width",
    "fill_to_budget",
    "one_document_rows",
    "resolve_batching",
    "split_to_count",
    "token_budget",
]
