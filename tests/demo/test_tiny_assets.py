"""The demo's data: validation prompts are task instances that training never sees."""

from __future__ import annotations

import json
import random

from nemo_automodel_ext.demo.tiny_assets import ensure_tiny_assets
from nemo_automodel_ext.demo.tiny_tasks import conversation, held_out


def _prompts(path):
    return [
        json.loads(line)["messages"][0]["content"].removeprefix("please ") for line in path.read_text().splitlines()
    ]


def test_generated_validation_prompts_are_disjoint_from_training(tmp_path):
    assets = ensure_tiny_assets(tmp_path / "assets", train_samples=400)
    train, val = _prompts(assets / "train.jsonl"), _prompts(assets / "val.jsonl")
    assert len(val) == 20 and len(train) == 400
    assert not set(train) & set(val)
    assert all(held_out(prompt) for prompt in val) and not any(held_out(prompt) for prompt in train)


def test_split_is_a_property_of_the_instance_whatever_the_seed():
    """Splits drawn with different seeds and counts still never share an instance (about 5% held out)."""
    train = {conversation(random.Random(seed), "train")["messages"][0]["content"] for seed in range(3000)}
    val = {conversation(random.Random(seed), "val")["messages"][0]["content"] for seed in range(3000)}
    assert not train & val
    everything = [conversation(random.Random(seed))["messages"][0]["content"] for seed in range(4000)]
    share = sum(map(held_out, everything)) / len(everything)
    assert 0.03 < share < 0.07, share
