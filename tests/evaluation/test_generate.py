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
    assert packed_predictions(wrapper.model, sequences, width=64, max_batch_tokens=128) == alone
    # Rows of their length classes (64 and 128 here, the default widest row 2,048): the same predictions.
    assert packed_predictions(wrapper.model, sequences) == alone
    with pytest.raises(ValueError, match=r"sequences\[1\] is empty"):
        packed_predictions(wrapper.model, [[4, 5], []])


def test_a_sequence_runs_in_the_row_of_its_length_class():
    import torch

    from nemo_automodel_ext.models.deepseek_v41.length_classes import class_widths

    lengths = torch.tensor([1, 40, 64, 65, 128, 129, 1500, 2048, 2049])
    assert class_widths(lengths, 2048).tolist() == [64, 64, 64, 128, 128, 256, 2048, 2048, 2049]  # 2049: alone
    assert class_widths(torch.tensor([90]), 96).tolist() == [96]  # a widest row that is no power of two


def test_greedy_decoding_of_mixed_lengths_is_each_prompt_s_own(demo_pair):
    """Prompts of distinct lengths decode together as packed documents; each gets what decoding it alone token by
    token with ``causal_logits`` (the naive reference) gives, stopping at its own EOS."""
    import torch

    from nemo_automodel_ext.evaluation.generate import causal_logits

    wrapper, _, _, tokenizer = demo_pair
    eos = tokenizer.eos_token_id
    prompts = [list(s.prompt) for s in demo_sequences(5, seed=6)]
    prompts.append(prompts[0] + [11, 12, 13])
    reference = []
    for prompt in prompts:
        tokens = []
        while len(tokens) < 12 and (not tokens or tokens[-1] != eos):
            tokens.append(int(causal_logits(wrapper.model, torch.tensor([prompt + tokens]))[0, -1].argmax()))
        reference.append(tokens)
    assert greedy_generate(wrapper.model, prompts, 12, eos) == reference
