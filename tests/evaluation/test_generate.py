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


def test_packed_predictions_are_each_sequence_s_own(demo_pair):
    """Sequences of mixed lengths sharing packed rows (several rows a batch, several batches, one sequence wider
    than a row) get the argmax that ``causal_logits`` gives each of them alone."""
    import torch

    from nemo_automodel_ext.evaluation.generate import causal_logits, packed_predictions

    wrapper, _, _, _ = demo_pair
    sequences = [[*s.prompt, *s.continuation] for s in demo_sequences(9, seed=4)]
    sequences.append(sequences[0] + sequences[1] + sequences[2])  # wider than the rows
    alone = [causal_logits(wrapper.model, torch.tensor([s])).argmax(-1)[0].tolist() for s in sequences]
    assert packed_predictions(wrapper.model, sequences, width=64, max_batch_tokens=128) == alone
    with pytest.raises(ValueError, match=r"sequences\[1\] is empty"):
        packed_predictions(wrapper.model, [[4, 5], []])
