"""Greedy generation with verified guesses equals plain greedy decoding."""

from __future__ import annotations

import pytest
from evaluation.demo_pair import demo_sequences

from nemo_automodel_ext.evaluation.generate import greedy_generate


def test_guesses_only_speed_up_greedy_decoding(demo_pair):
    wrapper, _, _, tokenizer = demo_pair
    sequences = demo_sequences(12, seed=3)
    prompts = [sequence.prompt for sequence in sequences]
    eos = tokenizer.eos_token_id
    plain = greedy_generate(wrapper.model, prompts, 20, eos)
    right = [list(sequence.continuation) for sequence in sequences]  # the dataset answers (the target solves them)
    wrong = [[*answer[:2], (answer[2] + 5) % 300 + 7, *answer[3:]] for answer in right]
    for guesses in (right, wrong, [[] for _ in prompts], [answer[:3] for answer in right]):
        assert greedy_generate(wrapper.model, prompts, 20, eos, guesses=guesses) == plain
    with pytest.raises(ValueError, match="guesses"):
        greedy_generate(wrapper.model, prompts, 20, eos, guesses=right[:3])
