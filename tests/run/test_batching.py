"""``run/batching.py``: token-budget micro-batches of one conversation a row (``dynamic``, ``grouped``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_automodel_ext.evaluation.sequences import as_packed_rows
from nemo_automodel_ext.run.batching import (
    TokenBudgetBatchSampler,
    build_token_budget_dataloader,
    fill_to_budget,
    one_document_rows,
    split_to_count,
)


def long_tailed(count: int, seed: int, width: int = 512) -> list[int]:
    """Lognormal lengths (median about 60), a few near the row width."""
    rng = random.Random(seed)
    return [max(2, min(width, int(rng.lognormvariate(4.1, 0.9)))) for _ in range(count)]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=80),
    budget=st.integers(64, 300),
    grouped=st.booleans(),
    replicas=st.sampled_from([1, 2, 3]),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_every_document_once_an_epoch_within_the_budget_equal_counts(lengths, budget, grouped, replicas, epochs, seed):
    if len(lengths) < replicas:
        return
    try:
        samplers = [
            TokenBudgetBatchSampler(
                lengths, budget, grouped=grouped, shuffle=True, seed=seed, epochs=epochs, num_replicas=replicas, rank=r
            )
            for r in range(replicas)
        ]
    except ValueError as error:  # only when ranks x batches cannot be reached without repeating a document
        assert "cannot make" in str(error)
        assert sum(length * 2 > budget for length in lengths) + (len(lengths) > 0) >= 1
        return
    counts = {len(sampler) for sampler in samplers}
    assert len(counts) == 1  # every rank takes the same number of micro-batches
    for epoch in range(epochs):
        seen = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert len(batches) == len(sampler)  # the same count every epoch
            for batch in batches:
                assert batch and len(batch) * max(lengths[i] for i in batch) <= budget
            seen += [index for batch in batches for index in batch]
        assert sorted(seen) == list(range(len(lengths)))


def test_order_is_fixed_by_seed_and_epoch_and_changes_between_epochs():
    lengths = long_tailed(300, 0)
    make = lambda: TokenBudgetBatchSampler(lengths, 1024, grouped=True, shuffle=True, seed=7, epochs=3)  # noqa: E731
    first, second = make(), make()
    first.set_epoch(2), second.set_epoch(2)
    assert list(first) == list(second)
    second.set_epoch(1)
    assert list(first) != list(second)


def padded_fraction(sampler: TokenBudgetBatchSampler, lengths: list[int]) -> float:
    batches = list(sampler)
    real = sum(lengths[i] for batch in batches for i in batch)
    return 1 - real / sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)


def test_grouping_by_length_pads_far_less_than_a_uniform_order():
    lengths = long_tailed(2000, 1)
    common = dict(shuffle=True, seed=0, epochs=1)
    dynamic = padded_fraction(TokenBudgetBatchSampler(lengths, 2048, grouped=False, **common), lengths)
    grouped = padded_fraction(TokenBudgetBatchSampler(lengths, 2048, grouped=True, **common), lengths)
    assert grouped < 0.15 < 0.3 < dynamic, (grouped, dynamic)


def test_fill_keeps_order_and_a_long_document_alone():
    assert fill_to_budget([2, 0, 1, 3], [10, 10, 30, 5], 30) == [[2], [0, 1, 3]]
    assert fill_to_budget([0, 2, 1], [10, 10, 30], 30) == [[0], [2], [1]]
    assert fill_to_budget([0], [99], 30) == [[0]]


def test_split_reaches_a_count_or_says_why():
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="cannot make 3 micro-batches"):
        split_to_count([[0], [1]], 3)
    with pytest.raises(ValueError, match="without merging"):
        split_to_count([[0], [1]], 1)


def test_rows_are_upstreams_packed_layout_of_one_document_padded_to_the_longest():
    features = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1]},
    ]
    batch = one_document_rows(features, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]
    assert batch["seq_lens"].tolist() == [[5], [5]]
    padded = {key: batch[key] for key in ("input_ids", "attention_mask", "loss_mask")}
    reference = as_packed_rows(padded)  # the evaluator's reading of a right-padded unpacked batch
    for key in ("seq_lens", "position_ids", "doc_remaining"):
        assert torch.equal(batch[key], reference[key]), key


def test_loader_resumes_mid_epoch_exactly(tmp_path):
    """The recipe's resume skips the micro-batches its checkpoint trained: the rest equal the uninterrupted epoch."""
    from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, conversation
    from nemo_automodel_ext.recipes.resume import ResumedEpochLoader

    rng = random.Random(0)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(120)))
    tokenizer = build_tokenizer()

    def loader():
        return build_token_budget_dataloader(
            data_path=str(path),
            tokenizer=tokenizer,
            seq_length=64,
            budget=256,
            grouped=True,
            shuffle=True,
            shuffle_seed=3,
            epochs=2,
        )

    full = loader()
    full.batch_sampler.set_epoch(1)
    expected = [batch["input_ids"] for batch in full]
    assert all(batch.shape[0] * batch.shape[1] <= 256 for batch in expected)
    resumed = ResumedEpochLoader(loader(), skip=4)
    resumed.sampler.set_epoch(1)  # what the recipe's loop calls
    got = [batch["input_ids"] for batch in resumed]
    assert len(got) == len(expected) - 4 and all(torch.equal(a, b) for a, b in zip(got, expected[4:]))
    documents = sum(batch.shape[0] for batch in expected)
    assert documents == 120


def test_recipe_config_keys(tmp_path):
    from nemo_automodel.components.config.loader import load_yaml_config

    from nemo_automodel_ext.run.config import validate_recipe_config

    cfg = load_yaml_config(Path(__file__).resolve().parents[2] / "recipes/deepseek_v41/dspark_tiny_cpu.yaml")
    assert validate_recipe_config(cfg, 1, "cpu")["batching"] == "packed"  # implied by packed_sequence_size
    cases = [
        ({"batching": "dynamic"}, "batches one conversation a row: set recipe_args.packed_sequence_size: 0"),
        ({"batching": "packed", "packed_sequence_size": 0}, "needs recipe_args.packed_sequence_size > 0"),
        ({"batching": "bucketed", "packed_sequence_size": 0}, "batching must be one of"),
        ({"tokens_per_micro_batch": 512}, "tokens_per_micro_batch is for batching: dynamic or grouped"),
        ({"batching": "grouped", "packed_sequence_size": 0, "tokens_per_micro_batch": 64}, "must hold one"),
    ]
    for changes, fragment in cases:
        changed = load_yaml_config(Path(__file__).resolve().parents[2] / "recipes/deepseek_v41/dspark_tiny_cpu.yaml")
        for key, value in changes.items():
            changed.set_by_dotted(f"recipe_args.{key}", value)
        with pytest.raises(ValueError, match=fragment):
            validate_recipe_config(changed, 1, "cpu")
    cfg.set_by_dotted("recipe_args.batching", "grouped")
    cfg.set_by_dotted("recipe_args.packed_sequence_size", 0)
    assert validate_recipe_config(cfg, 1, "cpu")["batching"] == "grouped"


def test_held_out_prompts_are_packed_alike_whatever_the_batching(tmp_path):
    """Every batching's draft is scored on the same batches: held-out prompts packed in order into rows of
    ``evaluation_row_width`` (the packed row, else ``seq_length``), several conversations a row. ``upstream`` once
    padded each to ``seq_length`` in a row of its own: on the long-tailed mix (1,256 tokens) its runs lasted 5.3-5.5x
    their training seconds, the other batchings' about 2x."""
    from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, conversation
    from nemo_automodel_ext.run.batching import build_recipe_dataloader, evaluation_row_width

    rng = random.Random(1)
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(40)))
    tokenizer = build_tokenizer()
    common = {
        "seq_length": 128,
        "micro_batch_size": 2,
        "num_workers": 0,
        "shuffle_seed": 7,
        "num_epochs": 1,
        "tokens_per_micro_batch": None,
        "mask_reasoning_content": False,
        "mask_generation_prompt": False,
    }
    layouts = {}
    for batching in ("packed", "upstream", "dynamic", "grouped"):
        args = {**common, "batching": batching, "packed_sequence_size": 128 if batching == "packed" else 0}
        assert evaluation_row_width(args) == 128
        layouts[batching] = list(build_recipe_dataloader(args, tokenizer, str(path), None, train=False))
    reference = layouts.pop("packed")
    assert all(batch["input_ids"].shape == (2, 128) for batch in reference[:-1])
    assert sum(int((batch["seq_lens"] > 0).sum()) for batch in reference) == 40  # each conversation once
    assert sum(batch["input_ids"].shape[0] for batch in reference) < 40 / 3  # in rows of several
    for batching, batches in layouts.items():
        assert len(batches) == len(reference), batching
        for got, expected in zip(batches, reference, strict=True):
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[key], expected[key]) for key in expected), batching
    # training still batches as each names: upstream pads every conversation to seq_length, one a row
    upstream = {**common, "batching": "upstream", "packed_sequence_size": 0}
    first = next(iter(build_recipe_dataloader(upstream, tokenizer, str(path), None, train=True)))
    assert first["input_ids"].shape == (2, 128) and "seq_lens" not in first
    assert first["attention_mask"].sum(dim=1).lt(64).all()  # a short conversation, padded to the row
