"""Reference speculative decoding, one prompt and one round at a time, through public forwards only.

Each round runs a fresh target forward over the committed prefix, then the draft decodes its
block token by token: proposal k comes from the draft's training forward with its own earlier
proposals in the label slots, so its Markov head reads its own previous proposal. The target
verifies with a second forward over prefix + block. Nothing here is shared with the evaluator.
"""

from __future__ import annotations

import torch

from nemo_automodel_ext.models.deepseek_v41.dspark_target import prepare_packed_inputs


def _draft_slot_logits(draft, committed, proposals, features, block, pad):
    """Logits of draft slot len(proposals), with the draft's own proposals as its Markov inputs."""
    anchor = len(committed) - 1
    sequence = committed + proposals + [pad] * (block - len(proposals))
    context = torch.zeros(1, len(sequence), features.shape[-1])
    context[:, : features.shape[1]] = features
    output = draft(
        torch.tensor([sequence]), context, torch.ones(1, len(sequence)), anchor_positions=torch.tensor([[anchor]])
    )
    return output.draft_logits[0, 0, len(proposals)]


def _logits(model, tokens):
    """The target's logits [1, sequence, vocab] over ``tokens`` alone: one packed document, a fresh forward."""
    ids = torch.tensor([tokens])
    layout, inputs = prepare_packed_inputs(model, ids, torch.tensor([[len(tokens)]]))
    return layout.restore(model(**inputs).logits)


def _features(wrapper, committed):
    ids = torch.tensor([committed])
    ones = torch.ones_like(ids)
    return wrapper.generate_batch(ids, ones, ones, seq_lens=torch.tensor([[len(committed)]])).target_hidden_states


def _stop(tokens, generated, max_new, eos):
    tokens = tokens[: max_new - generated]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@torch.no_grad()
def naive_greedy(wrapper, draft, prompt, max_new, eos, pad):
    """Greedy speculative decoding; returns (tokens committed per round, generated text)."""
    model, block = wrapper.model, draft.config.dspark_block_size
    committed = list(prompt)
    committed.append(int(_logits(model, committed)[0, -1].argmax()))
    generated, rounds = 1, []
    while generated < max_new and committed[-1] != eos:
        features = _features(wrapper, committed)
        proposals = []
        for _ in range(block):
            proposals.append(int(_draft_slot_logits(draft, committed, proposals, features, block, pad).argmax()))
        anchor = len(committed) - 1
        greedy = _logits(model, committed + proposals)[0, anchor:].argmax(-1).tolist()
        accepted = 0
        while accepted < block and proposals[accepted] == greedy[accepted]:
            accepted += 1
        new = _stop(proposals[:accepted] + [greedy[accepted]], generated, max_new, eos)
        rounds.append(len(new))
        committed += new
        generated += len(new)
    return rounds, committed[len(prompt) :]


@torch.no_grad()
def naive_sampled(wrapper, draft, prompt, temperature, generator, max_new, eos, pad):
    """Sampling verification, slot by slot; returns tokens committed per round."""
    model, block = wrapper.model, draft.config.dspark_block_size

    image_token_id = wrapper.model.config.image_token_id

    def probs(logits):  # text-only, as the evaluator: the image placeholder is never sampled
        logits = logits.float() / temperature
        logits[..., image_token_id] = float("-inf")
        return torch.softmax(logits, dim=-1)

    def draw(distribution):
        return int(torch.multinomial(distribution, 1, generator=generator))

    committed = list(prompt)
    committed.append(draw(probs(_logits(model, committed)[0, -1])))
    generated, rounds = 1, []
    while generated < max_new and committed[-1] != eos:
        features = _features(wrapper, committed)
        proposals, draft_probs = [], []
        for _ in range(block):
            distribution = probs(_draft_slot_logits(draft, committed, proposals, features, block, pad))
            draft_probs.append(distribution)
            proposals.append(draw(distribution))
        anchor = len(committed) - 1
        target_probs = probs(_logits(model, committed + proposals)[0, anchor:])
        new = []
        for slot in range(block):
            p, q = target_probs[slot, proposals[slot]], draft_probs[slot][proposals[slot]]
            if float(torch.rand((), generator=generator)) * q < p:
                new.append(proposals[slot])
                continue
            residual = (target_probs[slot] - draft_probs[slot]).clamp_min(0)
            new.append(draw(residual / residual.sum() if residual.sum() > 1e-8 else target_probs[slot]))
            break
        else:
            new.append(draw(target_probs[block]))
        new = _stop(new, generated, max_new, eos)
        rounds.append(len(new))
        committed += new
        generated += len(new)
    return rounds
