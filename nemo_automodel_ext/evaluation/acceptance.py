"""Acceptance length (tau) of a V4.1 DSpark draft against its target: exact greedy replay and sampling.

Definitions (DeepSpec's and SpecForge's): a verify round is one target pass over the draft's
block; it commits the accepted draft tokens plus one token of the target's (the correction, or
the bonus after a fully accepted block). ``tau`` is the mean number of tokens committed per round,
``accepted + 1``, at most ``block + 1``; the last round of a generation commits only what is left
before the end (EOS or the token limit). ``acceptance[k]`` is the rate at which block slot ``k``
is accepted among rounds that reached it (every earlier slot accepted).

Greedy verification is replayed exactly, without decoding (``greedy_replay``): under greedy
verification the committed text is the target's greedy text whatever the draft proposes, so one
target forward over prompt + greedy continuation gives every context the draft will ever see
(the target is causal), and one draft forward with an anchor at every continuation position gives
every block it will ever propose. Slot k's Markov input is teacher-forced to the continuation
token before it, which equals the draft's own proposal for every slot up to and including the
first mismatch, the only slots whose outcome counts. The round-by-round walk through those
blocks is then bookkeeping. ``docs/evaluation.md`` states the argument in full;
``tests/evaluation`` checks it round for round against a decoding loop.

Sampling verification at a temperature (``sampled_decode``) has no such shortcut: the text
depends on the draws. It decodes all prompts in lockstep rounds, one packed target forward and
one draft forward per round, accepting each proposal with probability min(1, p/q), resampling
the residual max(0, p - q) on rejection and adding the bonus token, from one seeded generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from nemo_automodel_ext.evaluation.sequences import EvalSequence, as_packed_rows, pack_sequences
from nemo_automodel_ext.models.deepseek_v41.anchors import compact_anchors
from nemo_automodel_ext.models.deepseek_v41.packing import document_bounds


@dataclass
class AcceptanceStats:
    """Sums over verify rounds; ``merge`` adds two, ``summary`` gives the rates.

    Attributes:
        block_size: Draft block size (slots per round).
        rounds: Verify rounds (target passes after the prefill).
        committed: Tokens the rounds committed (accepted + correction or bonus, capped at the end).
        reached: Per slot [block_size]: rounds whose block reached the slot.
        accepted: Per slot [block_size]: rounds that accepted it.
        sequences: Continuations with at least one round.
        offered_tokens: Continuation tokens offered (from the data or generated).
        agreed_tokens: Of those, tokens on the target's greedy path (the trajectory replayed).
        per_sequence: Optional tokens committed per round, per sequence index (for tests).
    """

    block_size: int
    rounds: int = 0
    committed: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    sequences: int = 0
    offered_tokens: int = 0
    agreed_tokens: int = 0
    per_sequence: dict[int, list[int]] | None = None

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.block_size
        self.accepted = self.accepted or [0] * self.block_size

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify round (nan without rounds)."""
        return self.committed / self.rounds if self.rounds else float("nan")

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """Add ``other``'s sums into this one (in place) and return it."""
        self.rounds += other.rounds
        self.committed += other.committed
        self.reached = [a + b for a, b in zip(self.reached, other.reached, strict=True)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted, strict=True)]
        self.sequences += other.sequences
        self.offered_tokens += other.offered_tokens
        self.agreed_tokens += other.agreed_tokens
        if other.per_sequence is not None:
            self.per_sequence = {**(self.per_sequence or {}), **other.per_sequence}
        return self

    def reduced(self, all_reduce) -> AcceptanceStats:
        """The sums over ranks: ``all_reduce`` sums a 1-D integer tensor (a collective: every rank calls it)."""
        counts = [self.rounds, self.committed, self.sequences, self.offered_tokens, self.agreed_tokens]
        values, block = all_reduce(torch.tensor([*counts, *self.reached, *self.accepted])).tolist(), self.block_size
        return AcceptanceStats(
            block,
            rounds=values[0],
            committed=values[1],
            sequences=values[2],
            offered_tokens=values[3],
            agreed_tokens=values[4],
            reached=values[5 : 5 + block],
            accepted=values[5 + block :],
        )

    def summary(self) -> dict[str, float | int | list[float]]:
        """JSON-ready rates: ``tau``, per-slot ``acceptance``, rounds, tokens, agreement."""
        return {
            "tau": self.tau,
            "acceptance": [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)],
            "rounds": self.rounds,
            "committed_tokens": self.committed,
            "sequences": self.sequences,
            "offered_tokens": self.offered_tokens,
            "agreed_tokens": self.agreed_tokens,
            "agreement": self.agreed_tokens / self.offered_tokens if self.offered_tokens else float("nan"),
        }


def target_predictions(head: nn.Module, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The target's greedy next token after every column: argmax of ``head`` [batch, row] (chunked over columns)."""
    columns = last_hidden.shape[1]
    return torch.cat(
        [head(last_hidden[:, i : i + chunk].to(head.weight.dtype)).argmax(dim=-1) for i in range(0, columns, chunk)]
        or [last_hidden.new_zeros(last_hidden.shape[0], 0, dtype=torch.long)],
        dim=1,
    )


def _clean_prefix(bad: torch.Tensor, started: torch.Tensor, document_start: torch.Tensor) -> torch.Tensor:
    """Columns after a document's start marker and before its first ``bad`` column (inclusive of neither)."""
    running = (bad & started).long().cumsum(dim=1)
    before = running.gather(1, (document_start - 1).clamp_min(0)) * (document_start > 0)
    return started & (running - before == 0)


@torch.no_grad()
def greedy_replay(
    target, draft, batch: dict[str, torch.Tensor], max_anchors: int = 2048, keep_rounds: bool = False
) -> AcceptanceStats:
    """Exact acceptance of greedy speculative decoding over the continuations of a packed batch.

    Each document's continuation is its first run of ``loss_mask`` tokens. The replayed
    trajectory is its longest prefix that the target's own greedy decoding produces; a dataset
    answer that leaves the target's greedy path is cut there (``agreed_tokens`` counts what is kept).

    Args:
        target: ``DeepseekV41DSparkTargetModel`` (its packed capture is the one training uses).
        draft: ``DeepseekV41PackedDSparkModel``.
        batch: Packed batch in the recipe's format (``pack_sequences`` or the validation loader):
            ``input_ids``, ``loss_mask``, ``attention_mask``, ``position_ids``, ``doc_remaining``
            [rows, row] and ``seq_lens`` [rows, documents]; optional ``sequence_index``. An unpacked
            loader's batch (one right-padded conversation a row) is read as one document a row
            (``sequences.as_packed_rows``).
        max_anchors: Anchors per draft forward (the draft's logits are [rows, anchors, block, vocab]).
        keep_rounds: Record the tokens committed per round for every sequence.

    Returns:
        AcceptanceStats of the batch. Nothing is modified.
    """
    device = next(draft.parameters()).device
    batch = as_packed_rows({key: value.to(device) for key, value in batch.items()})
    ids, seq_lens = batch["input_ids"], batch["seq_lens"]
    rows, width = ids.shape
    block = draft.config.dspark_block_size
    capture = target.generate_batch(
        ids,
        batch["attention_mask"],
        batch["loss_mask"],
        position_ids=batch["position_ids"],
        seq_lens=seq_lens,
        doc_remaining=batch["doc_remaining"],
    )
    predicted = target_predictions(target.get_output_embeddings(), capture.target_last_hidden_states)

    # The replayed trajectory: continuation tokens on the target's greedy path, from the first one.
    columns = torch.arange(width, device=device).expand(rows, width)
    bounds = document_bounds(seq_lens, columns)
    continuation = batch["loss_mask"] > 0
    agrees = torch.zeros_like(continuation)
    agrees[:, 1:] = (ids[:, 1:] == predicted[:, :-1]) & (bounds.start[:, 1:] < columns[:, 1:])
    seen = continuation.long().cumsum(dim=1)
    started = seen - seen.gather(1, (bounds.start - 1).clamp_min(0)) * (bounds.start > 0) > 0
    offered = _clean_prefix(~continuation, started, bounds.start)
    valid = _clean_prefix(~(continuation & agrees), started, bounds.start)

    # Longest accepted run of a block anchored at every trajectory column with a token after it.
    runs = torch.zeros(rows, width, dtype=torch.long, device=device)
    anchors, keep = compact_anchors(valid[:, :-1] & valid[:, 1:])
    for begin in range(0, anchors.shape[1], max_anchors):
        chunk, chunk_keep = anchors[:, begin : begin + max_anchors], keep[:, begin : begin + max_anchors]
        if not bool(chunk_keep.any()):
            continue
        output = draft(
            ids,
            capture.target_hidden_states,
            valid.float(),
            position_ids=batch["position_ids"],
            seq_lens=seq_lens,
            doc_remaining=batch["doc_remaining"],
            anchor_positions=chunk,
            block_keep_mask=chunk_keep,
        )
        matched = (output.draft_logits.argmax(dim=-1) == output.target_ids) & output.eval_mask
        run = matched.long().cumprod(dim=-1).sum(dim=-1).masked_fill_(~chunk_keep, 0)
        runs.scatter_add_(1, chunk, run)

    # Walk: a trajectory starts at its first token (the prefill's) and ends after its last.
    row_of, start = (valid & ~torch.nn.functional.pad(valid[:, :-1], (1, 0))).nonzero(as_tuple=True)
    counted = valid.long().cumsum(dim=1)
    before = counted[row_of, (start - 1).clamp_min(0)] * (start > 0)
    end = start + counted[row_of, bounds.end[row_of, start] - 1] - before
    index = batch.get("sequence_index")
    keys = (index[row_of, bounds.index[row_of, start]] if index is not None else torch.arange(len(start))).tolist()
    stats = walk_rounds(runs, row_of, start, end, block, keys if keep_rounds else None)
    stats.offered_tokens, stats.agreed_tokens = int(offered.sum()), int(valid.sum())
    return stats


def evaluate_greedy(target, draft, batches, max_anchors: int = 2048, all_reduce=None) -> AcceptanceStats:
    """``greedy_replay`` over every batch, summed (and over ranks by ``all_reduce`` if given).

    Args:
        target: ``DeepseekV41DSparkTargetModel``.
        draft: ``DeepseekV41PackedDSparkModel`` (switched to eval mode for the call, then restored).
        batches: Packed batches in the recipe's format (``pack_sequences`` or a validation loader).
        max_anchors: Anchors per draft forward.
        all_reduce: Sums a 1-D tensor over the data-parallel ranks that evaluated disjoint batches
            (the recipe's ``_dp_allreduce``), or None.

    Returns:
        The summed AcceptanceStats (identical on every rank ``all_reduce`` spans).
    """
    was_training = draft.training
    draft.eval()
    total = AcceptanceStats(draft.config.dspark_block_size)
    try:
        for batch in batches:
            total.merge(greedy_replay(target, draft, batch, max_anchors))
    finally:
        draft.train(was_training)
    return total.reduced(all_reduce) if all_reduce is not None else total


def walk_rounds(
    runs: torch.Tensor,
    row_of: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    block: int,
    keys: list[int] | None = None,
) -> AcceptanceStats:
    """Walk greedy verify rounds through precomputed accepted runs.

    Args:
        runs: Longest accepted run [rows, row] of the block anchored at each column.
        row_of, start, end: Per trajectory [trajectories]: its row, its first column (the
            prefill's token, the first anchor) and one past its last column.
        block: Draft block size.
        keys: Record the tokens committed per round under these per-trajectory keys.

    Returns:
        AcceptanceStats of the rounds (a round at anchor ``a`` commits ``min(run + 1, end - 1 - a)``).
    """
    stats = AcceptanceStats(block, per_sequence={key: [] for key in keys} if keys is not None else None)
    slots = torch.arange(block, device=runs.device)
    anchor = start.clone()
    reached = torch.zeros(block, dtype=torch.long, device=runs.device)
    accepted = torch.zeros_like(reached)
    stats.sequences = int((end - start >= 2).sum())
    while True:
        active = (end - anchor >= 2).nonzero(as_tuple=True)[0]
        if active.numel() == 0:
            break
        remaining = end[active] - 1 - anchor[active]
        run = runs[row_of[active], anchor[active]]
        committed = torch.minimum(run + 1, remaining)
        reached += ((slots <= run.unsqueeze(1)) & (slots < remaining.unsqueeze(1))).sum(dim=0)
        accepted += (slots < run.unsqueeze(1)).sum(dim=0)
        stats.rounds += active.numel()
        stats.committed += int(committed.sum())
        if keys is not None:
            for trajectory, tokens in zip(active.tolist(), committed.tolist()):
                stats.per_sequence[keys[trajectory]].append(tokens)
        anchor[active] += committed
    stats.reached, stats.accepted = reached.tolist(), accepted.tolist()
    return stats


def speculative_verify(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, proposals: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verification of draft blocks (Leviathan et al., Chen et al.).

    Slot i's proposal is accepted with probability min(1, p_i(d_i) / q_i(d_i)), in order, until
    the first rejection; the committed text is then distributed exactly as sampling the target.

    Args:
        target_probs: Target distributions [n, block + 1, vocab]; slot i is the target's
            distribution for the token proposal i stands in for, the last one after the block.
        draft_probs: Draft distributions [n, block, vocab] the proposals were drawn from.
        proposals: Proposed tokens [n, block].
        generator: Source of every random draw.

    Returns:
        ``accepted`` [n] (leading accepted proposals) and ``extra`` [n]: the token drawn from
        the residual max(0, p - q) (renormalised; p itself when it vanishes) at the first
        rejected slot, or from the bonus distribution after a fully accepted block.
    """
    n, block = proposals.shape
    p = target_probs[:, :block].gather(2, proposals.unsqueeze(-1)).squeeze(-1)
    q = draft_probs.gather(2, proposals.unsqueeze(-1)).squeeze(-1)
    draws = torch.rand(n, block, generator=generator, device=proposals.device)
    accepted = (draws * q < p).long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(n, device=proposals.device)
    at_stop = target_probs[rows, accepted]
    padded_q = torch.cat((draft_probs, torch.zeros_like(draft_probs[:, :1])), dim=1)[rows, accepted]
    residual = (at_stop - padded_q).clamp_min(0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 1e-8, residual, at_stop)
    extra = torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), 1, generator=generator).squeeze(1)
    return accepted, extra


def sampling_width(row_width: int, max_new_tokens: int) -> int:
    """Row width sampling verification packs its sequences into: the run's row, or room for two generations.

    Args:
        row_width: The run's packed row width (``packed_sequence_size`` or ``seq_length``).
        max_new_tokens: Generation limit per prompt.
    """
    return max(row_width, 2 * max_new_tokens)


@torch.no_grad()
def sampled_decode(
    target,
    draft,
    prompts: Sequence[Sequence[int]],
    temperature: float,
    seed: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    width: int = 1024,
    rows_per_batch: int = 8,
    keep_rounds: bool = False,
) -> AcceptanceStats:
    """Speculative decoding with sampling verification, all prompts in lockstep rounds.

    Each round runs the target once over every unfinished sequence (packed: committed tokens,
    the pending block, one spare column for the next anchor) and the draft once over one anchor
    per sequence; the draft samples its block slot by slot, its Markov head reading its own
    previous sample. Generation of a prompt stops after EOS or ``max_new_tokens``.

    Args:
        target: ``DeepseekV41DSparkTargetModel``.
        draft: ``DeepseekV41PackedDSparkModel``.
        prompts: Prompt token ids (non-empty each).
        temperature: Sampling temperature of target and draft (positive).
        seed: Seed of the one generator every draw comes from.
        max_new_tokens: Generation limit per prompt.
        eos_token_id: End-of-sequence token, or None.
        width, rows_per_batch: Packed row width and rows per target forward.
        keep_rounds: Record the tokens committed per round for every prompt.

    Returns:
        AcceptanceStats over all rounds (``offered_tokens`` = ``agreed_tokens`` = generated tokens).

    Raises:
        ValueError: for a non-positive temperature or ``max_new_tokens``, or an empty prompt.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be positive for sampling verification, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    decoding = _SampledDecoding(target, draft, prompts, temperature, seed, max_new_tokens, eos_token_id, keep_rounds)
    while decoding.unfinished:
        decoding.round(width, rows_per_batch)
    return decoding.finish()


class _SampledDecoding:
    """State of ``sampled_decode``: committed text, pending blocks and the statistics."""

    def __init__(self, target, draft, prompts, temperature, seed, max_new_tokens, eos_token_id, keep_rounds):
        self.target, self.draft = target, draft
        self.device = next(draft.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.temperature, self.max_new_tokens, self.eos = temperature, max_new_tokens, eos_token_id
        self.block = draft.config.dspark_block_size
        self.pad = int(target.model.config.text_config.pad_token_id or 0)
        self.image_token_id = getattr(target.model.config, "image_token_id", None)
        self.committed = [list(prompt) for prompt in prompts]
        self.generated = [0] * len(prompts)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # i -> (proposals [block], probs [block, V])
        self.unfinished = list(range(len(prompts)))
        self.stats = AcceptanceStats(self.block, per_sequence={i: [] for i in self.unfinished} if keep_rounds else None)

    def round(self, width: int, rows_per_batch: int) -> None:
        """One target pass over every unfinished sequence: verify (or prefill), then propose."""
        sequences = [
            EvalSequence((*self.committed[i], *(self.pending[i][0].tolist() if i in self.pending else ()), self.pad))
            for i in self.unfinished
        ]
        members = self.unfinished
        for packed in pack_sequences(sequences, width, rows_per_batch, self.pad):
            packed = {key: value.to(self.device) for key, value in packed.items()}
            located = (packed["sequence_index"] >= 0).nonzero(as_tuple=True)
            batch_members = [members[j] for j in packed["sequence_index"][located].tolist()]
            starts = (packed["seq_lens"].cumsum(dim=1) - packed["seq_lens"])[located]
            capture = self.target.generate_batch(
                packed["input_ids"],
                packed["attention_mask"],
                packed["loss_mask"],
                position_ids=packed["position_ids"],
                seq_lens=packed["seq_lens"],
                doc_remaining=packed["doc_remaining"],
            )
            self._commit(batch_members, located[0], starts, capture)
            self._propose(batch_members, located[0], starts, packed, capture)
        self.unfinished = [i for i in members if i in self.pending]

    def _commit(self, members, rows, starts, capture) -> None:
        """Verify each pending block (or sample the prefill token) against this pass's target."""
        last = torch.tensor([len(self.committed[i]) - 1 for i in members], device=self.device) + starts
        columns = last.unsqueeze(1) + torch.arange(self.block + 1, device=self.device)
        columns = columns.clamp(max=capture.target_last_hidden_states.shape[1] - 1)
        head = self.target.get_output_embeddings()
        states = capture.target_last_hidden_states[rows.unsqueeze(1), columns].to(head.weight.dtype)
        target_probs = self._probs(head(states))  # [m, block + 1, vocab]
        new_tokens: dict[int, list[int]] = {}
        verify = [j for j, i in enumerate(members) if i in self.pending]
        prefill = [j for j, i in enumerate(members) if i not in self.pending]
        if prefill:
            drawn = torch.multinomial(target_probs[prefill, 0], 1, generator=self.generator).squeeze(1)
            new_tokens.update({members[j]: [token] for j, token in zip(prefill, drawn.tolist())})
        if verify:
            proposals = torch.stack([self.pending[members[j]][0] for j in verify])
            draft_probs = torch.stack([self.pending[members[j]][1] for j in verify])
            accepted, extra = speculative_verify(target_probs[verify], draft_probs, proposals, self.generator)
            slots = torch.arange(self.block, device=self.device)
            reached = (slots <= accepted.unsqueeze(1)).sum(0).tolist()
            self.stats.reached = [a + b for a, b in zip(self.stats.reached, reached)]
            self.stats.accepted = [
                a + b for a, b in zip(self.stats.accepted, (slots < accepted.unsqueeze(1)).sum(0).tolist())
            ]
            self.stats.rounds += len(verify)
            for j, count, token, row in zip(verify, accepted.tolist(), extra.tolist(), proposals.tolist()):
                new_tokens[members[j]] = [*row[:count], token]
        for i, tokens in new_tokens.items():
            tokens = tokens[: self.max_new_tokens - self.generated[i]]
            if self.eos is not None and self.eos in tokens:
                tokens = tokens[: tokens.index(self.eos) + 1]
            if i in self.pending:
                self.stats.committed += len(tokens)
                if self.stats.per_sequence is not None:
                    self.stats.per_sequence[i].append(len(tokens))
                del self.pending[i]
            self.committed[i] += tokens
            self.generated[i] += len(tokens)

    def _propose(self, members, rows, starts, packed, capture) -> None:
        """Sample the next block of every continuing sequence from one draft forward (one anchor each)."""
        going = [
            j
            for j, i in enumerate(members)
            if self.generated[i] < self.max_new_tokens
            and not (self.eos is not None and self.committed[i][-1] == self.eos)
        ]
        if not going:
            return
        ids = packed["input_ids"].clone()
        slots_used: dict[int, int] = {}
        places = []
        for j in going:
            row, column = int(rows[j]), int(starts[j]) + len(self.committed[members[j]]) - 1
            ids[row, column] = self.committed[members[j]][-1]  # the new anchor token (the column held a spare pad)
            places.append((row, slots_used.get(row, 0), column))
            slots_used[row] = slots_used.get(row, 0) + 1
        anchors = torch.zeros(ids.shape[0], max(slots_used.values()), dtype=torch.long, device=self.device)
        keep = torch.zeros_like(anchors, dtype=torch.bool)
        row_index = torch.tensor([row for row, _, _ in places], device=self.device)
        slot_index = torch.tensor([slot for _, slot, _ in places], device=self.device)
        anchors[row_index, slot_index] = torch.tensor([column for _, _, column in places], device=self.device)
        keep[row_index, slot_index] = True
        base = self.draft.block_logits(
            ids, capture.target_hidden_states, anchors, keep, packed["position_ids"], packed["seq_lens"]
        )[row_index, slot_index]  # [m, block, vocab]
        previous = ids[row_index, anchors[row_index, slot_index]]
        proposals, probs = [], []
        for slot in range(self.block):
            distribution = self._probs(base[:, slot] + self.draft.markov_logits(previous))
            previous = torch.multinomial(distribution, 1, generator=self.generator).squeeze(1)
            proposals.append(previous)
            probs.append(distribution)
        proposals, probs = torch.stack(proposals, dim=1), torch.stack(probs, dim=1)
        for index, j in enumerate(going):
            self.pending[members[j]] = (proposals[index], probs[index])

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distribution at the temperature, text-only (no image placeholder token)."""
        logits = logits.float() / self.temperature
        if self.image_token_id is not None and 0 <= self.image_token_id < logits.shape[-1]:
            logits = logits.index_fill(-1, torch.tensor([self.image_token_id], device=logits.device), float("-inf"))
        return torch.softmax(logits, dim=-1)

    def finish(self) -> AcceptanceStats:
        self.stats.sequences = sum(1 for count in self.generated if count > 1)
        self.stats.offered_tokens = self.stats.agreed_tokens = sum(self.generated)
        return self.stats
