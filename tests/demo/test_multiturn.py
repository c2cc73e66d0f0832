"""The skewed multi-turn mix of the packing comparison: held-out prompts, the target's own answers, its tail."""

from __future__ import annotations

import json
import random

from nemo_automodel_ext.demo.demo_target import load_demo_target
from nemo_automodel_ext.demo.multiturn import LONG_TAILED, MAX_TURNS, ensure_multiturn_mix, turns
from nemo_automodel_ext.demo.tiny_assets import regenerate
from nemo_automodel_ext.demo.tiny_tasks import build_tokenizer, held_out


def test_turns_are_lognormal_with_a_long_bounded_tail():
    drawn = [turns(random.Random(seed)) for seed in range(4000)]
    assert min(drawn) == 1 and max(drawn) == MAX_TURNS
    median = sorted(drawn)[len(drawn) // 2]
    assert median == 3 and sum(d >= 8 for d in drawn) / len(drawn) > 0.1  # a tail of long conversations


def test_the_long_tailed_mix_reaches_the_row():
    """``LONG_TAILED``: a median of 9 exchanges (about 200 tokens), 1% or more at 60+ (over 1,300 tokens: a few
    conversations near the 2,048-token row), bounded by ``max_turns``."""
    drawn = [turns(random.Random(seed), LONG_TAILED) for seed in range(4000)]
    assert sorted(drawn)[len(drawn) // 2] == 9 and max(drawn) == LONG_TAILED.max_turns
    assert 0.01 <= sum(d >= 60 for d in drawn) / len(drawn) <= 0.05


def test_validation_prompts_are_held_out_and_every_answer_is_the_target_s(tmp_path):
    folder = ensure_multiturn_mix(tmp_path / "mix", train_samples=8, val_samples=4)
    samples = {
        split: [json.loads(line)["messages"] for line in (folder / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "val")
    }
    assert (len(samples["train"]), len(samples["val"])) == (8, 4)
    prompts = {
        split: [m["content"].removeprefix("please ") for c in conversations for m in c if m["role"] == "user"]
        for split, conversations in samples.items()
    }
    assert all(held_out(p) for p in prompts["val"]) and not any(held_out(p) for p in prompts["train"])
    assert not set(prompts["train"]) & set(prompts["val"])
    # Each assistant turn is what the target answers greedily given the conversation before it.
    model, tokenizer = load_demo_target(), build_tokenizer()
    for conversation in samples["train"][:3]:
        assert [m["role"] for m in conversation] == ["user", "assistant"] * (len(conversation) // 2)
        for end in range(2, len(conversation) + 1, 2):
            again = regenerate(model, tokenizer, [{"messages": conversation[:end]}])[0]["messages"]
            assert again == conversation[:end]


def test_whole_conversation_verification_equals_turn_by_turn_regeneration():
    """``regenerate_turns`` verifies a conversation's remaining planned answers in one packed forward; with right
    plans, wrong ones (a turn decoded on, the rest re-run after it) and truncated ones, every turn is what
    regenerating turn by turn gives: the target's greedy answer to the conversation before it."""
    from nemo_automodel_ext.demo.multiturn import SKEWED
    from nemo_automodel_ext.demo.tiny_assets import plan_turns, regenerate_turns

    model, tokenizer, rng = load_demo_target(), build_tokenizer(), random.Random(5)
    plans = [plan_turns(rng, "train", turns(rng, SKEWED) + 1) for _ in range(6)]
    plans[1][0][1] = {"role": "assistant", "content": "no"}  # a wrong first answer: decoded on
    plans[2][-1][1] = {"role": "assistant", "content": plans[2][-1][1]["content"] + " and more"}  # too long
    plans[3][1][1] = {"role": "assistant", "content": plans[3][1][1]["content"].split()[0]}  # stops early
    reference = []
    for plan in plans:
        messages = []
        for exchange in plan:
            messages = regenerate(model, tokenizer, [{"messages": messages + exchange}])[0]["messages"]
        reference.append({"messages": messages})
    assert regenerate_turns(model, tokenizer, plans) == reference
    assert [m["content"] for m in reference[1]["messages"][:2]] != [m["content"] for m in plans[1][0]]
    # The target falls silent off plan and the next turn is guessed empty (``_guessed_answer``), rightly and wrongly.
    after_silence = [
        sample["messages"][turn + 2]["content"]
        for sample, plan in zip(reference, plans)
        for turn in range(1, len(plan) * 2 - 2, 2)
        if sample["messages"][turn]["content"] == "" != plan[turn // 2][1]["content"]
    ]
    assert "" in after_silence and any(after_silence)


def test_a_conversation_answered_as_planned_takes_a_round_a_doubling_of_its_turns(monkeypatch):
    """With the target's own answers as the plan, a round verifies 1, 2, 4, ... turns of each conversation: a
    15-turn conversation takes 4 packed forwards (1 + 2 + 4 + 8 turns), not 15, and the text is unchanged."""
    from nemo_automodel_ext.demo import tiny_assets
    from nemo_automodel_ext.demo.tiny_assets import plan_turns, regenerate_turns

    model, tokenizer, rng = load_demo_target(), build_tokenizer(), random.Random(6)
    plans = [plan_turns(rng, "train", count) for count in (15, 3)]
    regenerated = regenerate_turns(model, tokenizer, plans)
    own = [
        [sample["messages"][turn : turn + 2] for turn in range(0, len(sample["messages"]), 2)] for sample in regenerated
    ]
    forwards = []
    predict = tiny_assets.packed_predictions
    monkeypatch.setattr(tiny_assets, "packed_predictions", lambda *a, **k: forwards.append(1) or predict(*a, **k))
    monkeypatch.setattr(tiny_assets, "finish_greedy", None)  # nothing is decoded: every guess holds
    assert regenerate_turns(model, tokenizer, own) == regenerated
    assert len(forwards) == 4
