"""The acceptance evaluator against an independent decoding loop, and the verification rule's law."""

from __future__ import annotations

import math

import pytest
import torch
from evaluation.demo_pair import demo_sequences
from evaluation.naive_decode import naive_greedy, naive_sampled

from nemo_automodel_ext.evaluation.acceptance import greedy_replay, sampled_decode, speculative_verify
from nemo_automodel_ext.evaluation.generate import greedy_generate
from nemo_automodel_ext.evaluation.sequences import EvalSequence, pack_sequences

MAX_NEW = 24


def test_greedy_replay_equals_decoding_round_for_round(demo_pair):
    """On 24 held-out prompts: same greedy text, and identical tokens committed in every round."""
    wrapper, draft, _, tokenizer = demo_pair
    prompts = [sequence.prompt for sequence in demo_sequences(24, seed=99)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    reference = [naive_greedy(wrapper, draft, list(prompt), MAX_NEW, eos, pad) for prompt in prompts]
    continuations = greedy_generate(wrapper.model, prompts, MAX_NEW, eos)
    assert continuations == [text for _, text in reference]
    batches = pack_sequences([EvalSequence(tuple(p), tuple(c)) for p, c in zip(prompts, continuations)], 128, 4, pad)
    rounds = {}
    total = None
    for batch in batches:
        stats = greedy_replay(wrapper, draft, batch, max_anchors=16, keep_rounds=True)
        rounds.update(stats.per_sequence)
        total = stats if total is None else total.merge(stats)
    assert [rounds.get(i, []) for i in range(len(prompts))] == [naive for naive, _ in reference]
    committed = sum(map(sum, (naive for naive, _ in reference)))
    assert total.committed == committed and total.rounds == sum(len(naive) for naive, _ in reference)
    assert total.tau > 1.25 and total.reached[-1] > 0, "the comparison needs many accepted proposals"
    assert total.agreed_tokens == total.offered_tokens  # generated text is the target's own


def test_unpacked_batches_replay_as_one_document_a_row(demo_pair):
    """An unpacked loader's batch (one right-padded conversation a row, no seq_lens) scores exactly what the
    same conversations score packed; the caller's tensors are untouched; a left-padded row is refused."""
    wrapper, draft, _, tokenizer = demo_pair
    prompts = [sequence.prompt for sequence in demo_sequences(8, seed=5)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    continuations = greedy_generate(wrapper.model, prompts, MAX_NEW, eos)
    sequences = [EvalSequence(tuple(p), tuple(c)) for p, c in zip(prompts, continuations)]
    width = max(len(p) + len(c) for p, c in zip(prompts, continuations)) + 3
    ids = torch.full((len(sequences), width), pad)
    loss_mask, attention = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        tokens = [*prompt, *continuation]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        loss_mask[row, len(prompt) : len(tokens)] = 1
    unpacked = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    before = {key: value.clone() for key, value in unpacked.items()}
    stats = greedy_replay(wrapper, draft, unpacked)
    assert set(unpacked) == set(before) and all(torch.equal(unpacked[k], before[k]) for k in before)
    packed = None
    for batch in pack_sequences(sequences, 128, 4, pad):
        one = greedy_replay(wrapper, draft, batch)
        packed = one if packed is None else packed.merge(one)
    assert (stats.rounds, stats.committed, stats.reached, stats.accepted) == (
        packed.rounds,
        packed.committed,
        packed.reached,
        packed.accepted,
    )
    assert stats.sequences == len(sequences) and stats.reached[2] > 0  # accepted proposals to compare
    with pytest.raises(ValueError, match="right-padded"):
        greedy_replay(wrapper, draft, {**unpacked, "attention_mask": attention.flip(1)})


def test_greedy_replay_equals_decoding_past_the_window(demo_pair):
    """Sequences of 150-200 tokens (over twice the demo's 64-token window, ratio-1 indexer layers):
    the one-forward replay commits exactly what round-by-round decoding commits (issue 17 item 4)."""
    wrapper, draft, _, tokenizer = demo_pair
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    history = demo_sequences(40, seed=123)
    prompts = []
    for start in range(0, 32, 8):
        turns = [
            token for sequence in history[start : start + 8] for token in (*sequence.prompt, *sequence.continuation)
        ]
        prompts.append(turns[:150] + list(history[start + 8].prompt))
    assert min(map(len, prompts)) > 150
    reference = [naive_greedy(wrapper, draft, list(prompt), MAX_NEW, eos, pad) for prompt in prompts]
    continuations = greedy_generate(wrapper.model, prompts, MAX_NEW, eos)
    assert continuations == [text for _, text in reference]
    batches = pack_sequences([EvalSequence(tuple(p), tuple(c)) for p, c in zip(prompts, continuations)], 256, 1, pad)
    rounds = {}
    for batch in batches:
        rounds.update(greedy_replay(wrapper, draft, batch, max_anchors=64, keep_rounds=True).per_sequence)
    assert [rounds.get(i, []) for i in range(len(prompts))] == [naive for naive, _ in reference]


def test_dataset_answers_off_the_greedy_path_are_cut(demo_pair):
    """A dataset answer is replayed only up to its first token the target would not produce."""
    wrapper, draft, _, tokenizer = demo_pair
    sequence = demo_sequences(1, seed=5)[0]
    greedy = greedy_generate(wrapper.model, [sequence.prompt], MAX_NEW, tokenizer.eos_token_id)[0]
    assert len(greedy) >= 6
    wrong = list(greedy)
    wrong[4] = (wrong[4] + 1) % 300 + 7  # a token the target does not produce
    batch = pack_sequences([EvalSequence(sequence.prompt, tuple(wrong))], 128, 1, tokenizer.pad_token_id)[0]
    stats = greedy_replay(wrapper, draft, batch, keep_rounds=True)
    assert (stats.offered_tokens, stats.agreed_tokens) == (len(wrong), 4)
    assert sum(stats.per_sequence[0]) == 3  # tokens 1..3 follow the prefill's token 0


def test_sampled_decode_matches_the_naive_loop_in_distribution(demo_pair):
    """Mean tokens per round of both implementations agree within 4 standard errors (T = 1)."""
    wrapper, draft, _, tokenizer = demo_pair
    prompts = [sequence.prompt for sequence in demo_sequences(20, seed=7)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ours, theirs = [], []
    for seed in range(3):
        stats = sampled_decode(wrapper, draft, prompts, 1.0, seed, 16, eos, width=128, keep_rounds=True)
        ours += [tokens for rounds in stats.per_sequence.values() for tokens in rounds]
        generator = torch.Generator().manual_seed(1000 + seed)
        for prompt in prompts:
            theirs += naive_sampled(wrapper, draft, list(prompt), 1.0, generator, 16, eos, pad)

    def mean_var(values):
        mean = sum(values) / len(values)
        return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1)

    (m1, v1), (m2, v2) = mean_var(ours), mean_var(theirs)
    assert abs(m1 - m2) < 4 * math.sqrt(v1 / len(ours) + v2 / len(theirs)), (m1, m2, len(ours), len(theirs))
    assert m1 > 1.1  # the briefly trained draft is accepted at T = 1 too


def test_sampled_decode_builds_no_autograd_graph(demo_pair):
    """Sampling verification runs the target and the draft with gradients off (``torch.no_grad``), whatever the
    caller's mode."""
    wrapper, draft, _, tokenizer = demo_pair
    modes = {"target": [], "draft": []}
    handles = [
        module.register_forward_pre_hook(lambda _, args, name=name: modes[name].append(torch.is_grad_enabled()))
        for name, module in (("target", wrapper.model), ("draft", draft.layers[0]))
    ]
    try:
        prompts = [sequence.prompt for sequence in demo_sequences(2, seed=3)]
        sampled_decode(wrapper, draft, prompts, 1.0, 0, 4, tokenizer.eos_token_id, width=128)
    finally:
        for handle in handles:
            handle.remove()
    assert all(modes.values()) and not any(mode for seen in modes.values() for mode in seen), modes


def test_verification_commits_the_target_distribution():
    """Whatever the draft proposes, the first committed token is distributed as the target's p_0."""
    generator = torch.Generator().manual_seed(0)
    vocab, block, trials = 6, 3, 40000
    target = torch.softmax(torch.randn(block + 1, vocab, generator=generator), -1)
    draft = torch.softmax(2 * torch.randn(block, vocab, generator=generator), -1)
    proposals = torch.multinomial(draft.repeat(trials, 1), 1, replacement=True, generator=generator).view(trials, block)
    accepted, extra = speculative_verify(
        target.expand(trials, -1, -1), draft.expand(trials, -1, -1), proposals, generator
    )
    first = torch.where(accepted > 0, proposals[:, 0], extra)
    frequency = torch.bincount(first, minlength=vocab).float() / trials
    bound = 5 * (target[0] * (1 - target[0]) / trials).sqrt()
    assert ((frequency - target[0]).abs() < bound).all(), (frequency, target[0])
    # The acceptance rate of slot 0 is sum_x min(p, q).
    expected = torch.minimum(target[0], draft[0]).sum()
    assert abs(float((accepted > 0).float().mean()) - float(expected)) < 5 * math.sqrt(0.25 / trials)


def test_bad_arguments_are_refused(demo_pair):
    wrapper, draft, _, _ = demo_pair
    with pytest.raises(ValueError, match="temperature"):
        sampled_decode(wrapper, draft, [[1, 2]], 0.0, 0, 4, None)
    with pytest.raises(ValueError, match="prompt"):
        sampled_decode(wrapper, draft, [[]], 1.0, 0, 4, None)
    with pytest.raises(ValueError, match="empty"):
        greedy_generate(wrapper.model, [[]], 4, None)
