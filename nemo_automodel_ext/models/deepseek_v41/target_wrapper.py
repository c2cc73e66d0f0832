"""DSpark target wrapper for DeepSeek V4.1 that captures packed batches without a 4-D mask.

nemo_automodel 0.7.0's ``HFDSparkTargetModel`` turns ``seq_lens`` into a block-causal
[batch, 1, sequence, sequence] additive mask, which V4.1's forward refuses. This subclass
keeps upstream's capture points (the model-owned ``get_dspark_target_feature_modules``
pre-hooks and the final norm) and stream reduction, and runs packed batches through
``dspark_packed_forward``. On a dense-attention fallback (eager, SDPA) a target that runs alone
takes a packed batch's documents in rows of their length class (``length_classes.py``): the same
features, at a cost that follows the documents rather than the row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from nemo_automodel.components.speculative.dspark.target import DSparkTargetBatch, HFDSparkTargetModel
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from nemo_automodel_ext.models.deepseek_v41.cp import dspark_packed_forward_cp
from nemo_automodel_ext.models.deepseek_v41.cp_draft import DraftShard, draft_shard
from nemo_automodel_ext.models.deepseek_v41.dspark_target import (
    dspark_packed_forward,
    require_v41_target,
    uses_hybridep,
    validate_packed_batch,
)
from nemo_automodel_ext.models.deepseek_v41.length_classes import ClassRows, length_class_rows, relaying_pays
from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer


@dataclass
class DSparkShardBatch(DSparkTargetBatch):
    """One CP rank's capture for CP-native draft training (``cp_draft``).

    ``target_hidden_states`` [batch, shard.stop - shard.start, len(target_layer_ids) * hidden]
    holds the rank's shard and its feature halo, ``target_last_hidden_states`` [batch,
    shard.stop - shard.start, hidden] the shard and its teacher halo (zeros in the other halo);
    the token tensors are the caller's whole batch [batch, sequence].
    """

    shard: DraftShard | None = None


class DeepseekV41DSparkTargetModel(HFDSparkTargetModel):
    """Frozen V4.1 DSpark target: hooked feature capture on packed or unpacked batches.

    Args:
        model: ``DeepseekV41ForCausalLM`` target; put in eval mode with gradients disabled.
        target_layer_ids: Strictly increasing decoder-layer indices whose pre-attention
            residual streams form the draft context.
        cp_mesh: Optional context-parallel mesh. With more than one rank, packed batches are
            sharded contiguously over it and the captures gathered back (see ``cp.py``).
        length_classes: ``"auto"``: run a packed batch's documents in rows of their length class where that
            is safe (``runs_length_classes``) and modelled faster (``length_classes.relaying_pays``);
            ``"always"``: wherever it is safe; ``"never"``: the packed rows as given.
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        cp_mesh: DeviceMesh | None = None,
        length_classes: str = "auto",
    ):
        if length_classes not in ("auto", "always", "never"):
            raise ValueError(f"length_classes must be 'auto', 'always' or 'never', got {length_classes!r}")
        require_v41_target(model)
        # The model's own check raises a ValueError naming the rule (upstream's generic one asserts).
        model.get_dspark_target_feature_modules(list(target_layer_ids))
        # Vectorised, width-independent indexer selection (selection.py): prefix-consistent capture.
        install_packed_indexer(model)
        # Upstream's CP hooks patch HF SDPA attention, which V4.1 does not use: never pass a mesh up.
        super().__init__(model, target_layer_ids, cp_mesh=None)
        self.cp_mesh = cp_mesh if cp_mesh is not None and cp_mesh.size() > 1 else None
        self.length_classes = length_classes
        self.model.requires_grad_(False)

    def runs_length_classes(self) -> bool:
        """Whether packed batches may run in length-class rows: not ``"never"``, a dense-attention fallback (eager or
        SDPA: a token's cost grows with its row), and a target that runs alone. CP, HybridEP (equal widths
        on every rank) and a sharded target (FSDP2 or EP DTensors: collectives every forward, so every rank
        must run the same forwards) keep the packed rows."""
        return (
            self.length_classes != "never"
            and getattr(getattr(self.model, "backend", None), "attn", None) in ("eager", "sdpa")
            and self.cp_mesh is None
            and not uses_hybridep(self.model)
            and not any(isinstance(parameter, DTensor) for parameter in self.model.parameters())
        )

    def _capture(
        self, run: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    ) -> tuple[dict[object, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """Run ``run`` with the capture hooks installed; map every capture through its returned restore.

        Args:
            run: Runs the forward and returns the map from captured [batch, run_sequence, ...]
                tensors to caller coordinates [batch, sequence, ...].

        Returns:
            The captures in run coordinates, ``{layer_id: [batch, run_sequence, hidden]}`` (stream
            means) and ``{"norm": [batch, run_sequence, hidden]}``, and ``run``'s restore map.
        """
        captured: dict[object, torch.Tensor] = {}

        def feature_hook(layer_id: int):
            def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
                if not inputs:
                    raise RuntimeError(f"DSpark target feature module for layer {layer_id} received no input")
                # Reduce [batch, run_sequence, streams, hidden] at once: only the reduction is kept alive.
                captured[layer_id] = self._collapse_hc_streams(inputs[0])

            return hook

        def norm_hook(_module: nn.Module, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            captured["norm"] = output[0] if isinstance(output, tuple) else output

        handles = [
            module.register_forward_pre_hook(feature_hook(layer_id))
            for layer_id, module in zip(self.target_layer_ids, self._target_feature_modules, strict=True)
        ]
        handles.append(self._get_final_norm().register_forward_hook(norm_hook))
        try:
            restore = run()
        finally:
            for handle in handles:
                handle.remove()
        if "norm" not in captured or any(layer_id not in captured for layer_id in self.target_layer_ids):
            raise RuntimeError("DSpark target capture did not record every requested feature")
        return captured, restore

    @torch.no_grad()
    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        doc_remaining: torch.Tensor | None = None,
        **mm_kwargs: torch.Tensor,
    ) -> DSparkTargetBatch:
        """Run the target once and capture the DSpark context and final hidden state.

        Args:
            input_ids: Token IDs [batch, sequence].
            attention_mask: Binary right-padding mask [batch, sequence]; used on the unpacked path.
            loss_mask: Supervised-token mask [batch, sequence], passed through.
            position_ids: Optional per-document positions [batch, sequence], passed through
                (the packed layout derives its own).
            seq_lens: Optional packed document lengths [batch, documents]; each row sums to sequence.
            doc_remaining: Optional [batch, sequence] packing metadata, passed through.
            **mm_kwargs: Must be empty: V4.1 DSpark capture is text-only.

        Returns:
            DSparkTargetBatch with target_hidden_states [batch, sequence, len(target_layer_ids) * hidden]
            (stream means of each layer's pre-attention residual, as upstream reduces them),
            target_last_hidden_states [batch, sequence, hidden] (final-norm output), zero at packed
            padding slots, and the unmodified caller tensors.
        """
        if mm_kwargs:
            raise ValueError(f"DeepSeek V4.1 DSpark capture is text-only; got image inputs {sorted(mm_kwargs)}")

        if self.cp_mesh is not None and seq_lens is None:
            raise ValueError(
                "context parallelism for the V4.1 DSpark target needs packed batches (seq_lens); "
                "set recipe_args.packed_sequence_size > 0 or distributed.cp_size=1"
            )

        classes = self._length_classes(input_ids, seq_lens)
        if classes:
            features, norm = self._capture_length_classes(input_ids, classes)
            return DSparkTargetBatch(
                target_hidden_states=features,
                target_last_hidden_states=norm,
                input_ids=input_ids,
                loss_mask=loss_mask,
                position_ids=position_ids,
                seq_lens=seq_lens,
                doc_remaining=doc_remaining,
            )

        def run() -> Callable[[torch.Tensor], torch.Tensor]:
            if self.cp_mesh is not None:
                return dspark_packed_forward_cp(self.model, input_ids, seq_lens, self.cp_mesh)[1]
            if seq_lens is not None:
                return dspark_packed_forward(self.model, input_ids, seq_lens).restore
            self.model(input_ids, attention_mask=attention_mask, logits_to_keep=1)
            return lambda values: values

        captured, restore = self._capture(run)
        return DSparkTargetBatch(
            target_hidden_states=restore(self._features(captured)),
            target_last_hidden_states=restore(captured["norm"]),
            input_ids=input_ids,
            loss_mask=loss_mask,
            position_ids=position_ids,
            seq_lens=seq_lens,
            doc_remaining=doc_remaining,
        )

    @torch.no_grad()
    def generate_shard_batch(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        position_ids: torch.Tensor,
        seq_lens: torch.Tensor,
        doc_remaining: torch.Tensor,
        *,
        before: int,
        after: int,
    ) -> DSparkShardBatch:
        """Capture this CP rank's shard and fetch its draft halos from its peers (no all-gather).

        Every CP rank passes the same whole packed batch and must call it in the same order.

        Args:
            input_ids: Token IDs [batch, sequence].
            loss_mask, position_ids, doc_remaining: Packing tensors [batch, sequence], passed through.
            seq_lens: Document lengths [batch, documents]; each row sums to sequence.
            before: Feature halo columns (the draft's ``sliding_window``).
            after: Teacher halo columns (the draft's block size).

        Returns:
            DSparkShardBatch: local captures [batch, aligned_sequence / cp + halos, ...], the
            caller's tensors unmodified, and the rank's ``DraftShard``.
        """
        if self.cp_mesh is None:
            raise ValueError("generate_shard_batch needs a context-parallel mesh of more than one rank (cp_mesh)")
        if seq_lens is None or position_ids is None or doc_remaining is None:
            raise ValueError(
                "CP-native DSpark training needs packed batches (seq_lens, position_ids, doc_remaining); "
                "set recipe_args.packed_sequence_size > 0 or distributed.cp_size=1"
            )
        layouts = []

        def run() -> Callable[[torch.Tensor], torch.Tensor]:
            layouts.append(dspark_packed_forward_cp(self.model, input_ids, seq_lens, self.cp_mesh)[0])
            return lambda values: values

        captured, _ = self._capture(run)
        shard = draft_shard(layouts[0], self.cp_mesh.get_group(), before, after)
        return DSparkShardBatch(
            target_hidden_states=shard.exchange(self._features(captured), "before"),
            target_last_hidden_states=shard.exchange(captured["norm"], "after"),
            input_ids=input_ids,
            loss_mask=loss_mask,
            position_ids=position_ids,
            seq_lens=seq_lens,
            doc_remaining=doc_remaining,
            shard=shard,
        )

    def _length_classes(self, input_ids: torch.Tensor, seq_lens: torch.Tensor | None) -> list[ClassRows]:
        """The length classes of a packed batch to capture, or [] for the packed rows as given
        (``runs_length_classes`` says no, or ``relaying_pays`` does)."""
        if seq_lens is None or not self.runs_length_classes():
            return []
        validate_packed_batch(self.model, input_ids, seq_lens)
        classes = length_class_rows(seq_lens.to(input_ids.device), input_ids.shape[1])
        return classes if self.length_classes == "always" or relaying_pays(classes, *input_ids.shape) else []

    def _capture_length_classes(
        self, input_ids: torch.Tensor, classes: list[ClassRows]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed capture, one forward a length class.

        Args:
            input_ids: Token IDs [batch, sequence].
            classes: ``length_class_rows`` of the batch's ``seq_lens``.

        Returns:
            New tensors: the draft context [batch, sequence, len(target_layer_ids) * hidden] and the final-norm
            output [batch, sequence, hidden]: ``dspark_packed_forward``'s features of every document, up to fp32
            rounding (which the indexer's FP4 rounding and top-k can turn into another selection on a near-tie,
            as between the packed rows and each document alone).
        """
        batch, sequence = input_ids.shape
        pad = self.model.config.text_config.pad_token_id or 0
        features = norm = None
        for rows in classes:
            tokens = rows.pack(input_ids, fill=pad)

            def run(tokens=tokens, rows=rows) -> Callable[[torch.Tensor], torch.Tensor]:
                return dspark_packed_forward(self.model, tokens, rows.seq_lens).restore

            captured, restore = self._capture(run)
            context, last = restore(self._features(captured)), restore(captured["norm"])
            if features is None:
                features = context.new_zeros(batch * sequence, context.shape[-1])
                norm = last.new_zeros(batch * sequence, last.shape[-1])
            rows.scatter(context, features)
            rows.scatter(last, norm)
        return features.view(batch, sequence, -1), norm.view(batch, sequence, -1)

    def _features(self, captured: dict[object, torch.Tensor]) -> torch.Tensor:
        """The draft context [batch, run_sequence, len(target_layer_ids) * hidden] of one capture."""
        return torch.cat([captured[layer_id] for layer_id in self.target_layer_ids], dim=-1)


__all__ = ["DSparkShardBatch", "DeepseekV41DSparkTargetModel"]
