"""The demo's data: validation prompts are task instances that training never sees."""

from __future__ import annotations

import json
import random

from nemo_automodel_ext.demo.demo_target import load_demo_target
from nemo_automodel_ext.demo.tiny_assets import ensure_tiny_assets
from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, conversation, held_out


def _prompts(path):
    return [
        json.loads(line)["messages"][0]["content"].removeprefix("please ") for line in path.read_text().splitlines()
    ]


def test_generated_validation_prompts_are_disjoint_from_training(tmp_path):
    """Train, test (val.jsonl: every reported tau) and dev (dev.jsonl: where settings are chosen) are pairwise
    disjoint; dev and test are held-out instances; every dev answer is the target's greedy one."""
    assets = ensure_tiny_assets(tmp_path / "assets", train_samples=400)
    train, val = _prompts(assets / "train.jsonl"), _prompts(assets / "val.jsonl")
    dev = _prompts(assets / "dev.jsonl")
    assert len(val) == 20 and len(train) == 400 and len(dev) == 20 == len(set(dev))
    assert not set(train) & set(val) and not set(train) & set(dev) and not set(dev) & set(val)
    assert all(held_out(prompt) for prompt in val + dev) and not any(held_out(prompt) for prompt in train)
    samples = [json.loads(line) for line in (assets / "dev.jsonl").read_text().splitlines()]
    from nemo_automodel_ext.demo.tiny_assets import regenerate

    model, tokenizer = load_demo_target(), build_tokenizer()
    assert regenerate(model, tokenizer, samples) == samples  # already the target's greedy text
    (assets / "dev.jsonl").unlink()  # an asset folder from before dev prompts existed gets them
    assert ensure_tiny_assets(tmp_path / "assets", train_samples=400) and _prompts(assets / "dev.jsonl") == dev


def test_split_is_a_property_of_the_instance_whatever_the_seed():
    """Splits drawn with different seeds and counts still never share an instance (about 5% held out)."""
    train = {conversation(random.Random(seed), "train")["messages"][0]["content"] for seed in range(3000)}
    val = {conversation(random.Random(seed), "val")["messages"][0]["content"] for seed in range(3000)}
    assert not train & val
    everything = [conversation(random.Random(seed))["messages"][0]["content"] for seed in range(4000)]
    share = sum(map(held_out, everything)) / len(everything)
    assert 0.03 < share < 0.07, share
