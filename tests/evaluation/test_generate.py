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


def test_lookup_guess_continues_a_copy_or_a_loop():
    """Prompt-lookup guesses: the tokens after the latest earlier occurrence of the longest recurring suffix (at most
    ``ngram`` tokens), copied on into the copy itself so that a loop goes on; nothing when no suffix recurs."""
    from nemo_automodel_ext.evaluation.generate import lookup_guess

    assert lookup_guess([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # [1, 2] recurs: what followed it
    assert lookup_guess([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]  # a loop continues past the end
    assert lookup_guess([1, 7, 1, 8, 1], 2) == [8, 1]  # the latest occurrence of [1]
    assert lookup_guess([4, 1, 2, 3, 0, 2, 3, 5, 1, 2, 3], 1) == [0]  # the longest suffix [1, 2, 3] beats [2, 3]
    assert lookup_guess([1, 2, 3], 4) == [] and lookup_guess([1, 1], 0) == [] and lookup_guess([], 3) == []


def test_greedy_decoding_guesses_for_itself_in_fewer_forwards(monkeypatch):
    """Copy prompts: after the first copied word, prompt lookup guesses the rest and one forward confirms it. The
    text equals naive token-by-token decoding (``causal_logits`` alone), in fewer forwards than tokens."""
    import torch

    from nemo_automodel_ext.demo.demo_target import load_demo_target
    from nemo_automodel_ext.demo.tiny_tasks import COPY_WORDS, build_tokenizer
    from nemo_automodel_ext.evaluation import generate
    from nemo_automodel_ext.evaluation.generate import causal_logits
    from nemo_automodel_ext.evaluation.sequences import encode_conversation

    model, tokenizer = load_demo_target(), build_tokenizer()
    eos, prompts = tokenizer.eos_token_id, []
    for count in (3, 5, 8):
        messages = [{"role": "user", "content": "please copy " + " ".join(COPY_WORDS[count : 2 * count])}]
        full, prompt = encode_conversation(tokenizer, [*messages, {"role": "assistant", "content": "x"}])
        prompts.append(full[:prompt])
    reference = []
    for prompt in prompts:
        tokens = []
        while len(tokens) < 16 and (not tokens or tokens[-1] != eos):
            tokens.append(int(causal_logits(model, torch.tensor([prompt + tokens]))[0, -1].argmax()))
        reference.append(tokens)
    forwards = []
    predict = generate.packed_predictions
    monkeypatch.setattr(generate, "packed_predictions", lambda *a, **k: forwards.append(1) or predict(*a, **k))
    assert greedy_generate(model, prompts, 16, eos) == reference
    assert reference[2][:8] == [tokenizer.convert_tokens_to_ids(word) for word in COPY_WORDS[8:16]]  # copied
    assert len(forwards) <= 4 < max(len(tokens) for tokens in reference)


def test_packed_rows_cut_to_the_batch_s_fullest_row():
    """``trim``: a batch's rows are as wide as its fullest row (a longer sequence still gets a row of its own);
    without it every row is ``width`` wide."""
    from nemo_automodel_ext.evaluation.sequences import EvalSequence, pack_sequences

    sequences = [EvalSequence((1,) * 5, (2,) * 5), EvalSequence((3,) * 20, ()), EvalSequence((4,) * 3, (5,))]
    wide = pack_sequences(sequences, 64, 2, 0)
    cut = pack_sequences(sequences, 64, 2, 0, trim=True)
    assert [b["input_ids"].shape for b in wide] == [(1, 64)] and [b["input_ids"].shape for b in cut] == [(1, 34)]
    assert cut[0]["seq_lens"].tolist() == [[10, 20, 4, 0]]  # the padding document is empty
    assert (cut[0]["input_ids"] == wide[0]["input_ids"][:, :34]).all()
    one_each = pack_sequences(sequences, 20, 1, 0, trim=True)
    assert [b["input_ids"].shape[1] for b in one_each] == [10, 20, 4]  # a batch a row, each its own width
    assert pack_sequences([EvalSequence((1,) * 90, ())], 64, 1, 0, trim=True)[0]["input_ids"].shape == (1, 90)
