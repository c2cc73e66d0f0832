"""The packed V4.1 DSpark recipe's hooks into upstream's training loop, by concern.

``PackedDSparkLoopHooks`` is mixed into ``TrainPackedDSparkV41Recipe`` ahead of upstream's
``TrainDSparkRecipe``; each method overrides one of upstream's loop hooks and calls it:

- progress: resumed-epoch accounting, no tqdm bar, the step that flushes a partial accumulation window;
- evaluation: the greedy acceptance evaluation at checkpoints and validation, its metrics lines;
- the run's end: the servable export of the last checkpoint (``export.py``), the training curves;
- the step: real-token and data-checksum counters, the non-finite loss stop, the CP-native draft step;
- checkpoints: the counters and the run record beside upstream's DSpark meta.

The state they use (``acceptance``, ``_trailing``, counters, meshes) is built by the recipe's ``setup``.
"""

from __future__ import annotations

import logging
import pathlib
import time

import torch
import torch.distributed as dist
from nemo_automodel.components.checkpoint.utils import resolve_restore_from_to_checkpoint_dir
from nemo_automodel.components.loggers.metric_logger import MetricsSample
from nemo_automodel.recipes.llm._spec_train_utils import optim_steps_per_epoch

from nemo_automodel_ext.export import export_draft, require_rank_files_on_rank0
from nemo_automodel_ext.recipes.plots import plot_training_curves
from nemo_automodel_ext.recipes.refusals import report_refusal
from nemo_automodel_ext.recipes.resume import resume_advice
from nemo_automodel_ext.run.run_record import save_run_record

logger = logging.getLogger(__name__)


class PackedDSparkLoopHooks:
    """Overrides of ``TrainDSparkRecipe``'s loop hooks (see the module); mixed in before it."""

    def _consumed_batches_in_epoch(self, batches: int) -> int:
        """Micro-batches of the resumed epoch that the restored global step already trained on."""
        steps_per_epoch = optim_steps_per_epoch(batches, self.grad_accumulation_steps)
        done = self.runtime.global_step - self._resume_epoch * steps_per_epoch
        return min(max(done, 0) * self.grad_accumulation_steps, batches)

    def _make_progress_bar(self, total: int | None = None, initial: int = 0):
        """No tqdm bar: the progress line of each logged step carries the step, tokens/s and ETA."""
        return None

    def _maybe_save_step_checkpoint(self, epoch: int) -> bool:
        """Upstream's step checkpoint, then the greedy acceptance evaluation when it is due."""
        saved = super()._maybe_save_step_checkpoint(epoch)
        self._epoch = epoch
        flushed, self._micro_since_step = self._micro_since_step < self.grad_accumulation_steps, 0
        if self.runtime.global_step % self.log_every_steps == 0:
            if flushed:  # upstream logs full accumulation windows only
                self._log_flushed_step(epoch)
            self._trailing.reset()
        if self.acceptance.due(self.runtime.global_step):
            self._log_eval(self._untimed(self.acceptance.run, self.runtime.global_step))
        return saved

    def _untimed(self, evaluate, *args):
        """``evaluate(*args)``, its seconds left out of the training time ``metrics.jsonl`` records (``train_s``)."""
        start = time.perf_counter()
        try:
            return evaluate(*args)
        finally:
            if self.metric_logger is not None:
                self.metric_logger.exclude(time.perf_counter() - start)

    def _log_flushed_step(self, epoch: int) -> None:
        """Log the step that flushed an epoch's partial accumulation window (every rank: one all-reduce)."""
        metrics = self._trailing.averages(self._dp_allreduce)
        if self.dist_env.is_main:
            metrics.update(lr=self.lr_scheduler.get_last_lr()[0], mem=0.0)
            self.metric_logger.log(MetricsSample(step=self.runtime.global_step, epoch=epoch, metrics=metrics))

    def _run_eval(self):
        """Upstream's teacher-forced validation (not counted as training tokens) plus greedy acceptance."""
        self._counting_tokens = False
        try:
            metrics = self._untimed(super()._run_eval)
        finally:
            self._counting_tokens = True
        if metrics is None:
            return None
        metrics.update(self._untimed(self.acceptance.run, self.runtime.global_step))
        self._log_eval(metrics, wandb=False)  # upstream logs the returned metrics to W&B
        return metrics

    def _log_eval(self, metrics: dict[str, float], wandb: bool = True) -> None:
        if not self.dist_env.is_main or self.metric_logger is None:
            return
        self.metric_logger.log_eval(self.runtime.global_step, self._epoch, metrics)
        if wandb:
            self._wandb_log({f"val/{key}": value for key, value in metrics.items()}, step=self.runtime.global_step)

    def run_train_validation_loop(self):
        """Upstream's loop, after a step-0 acceptance baseline; rank 0 then draws ``training_curves.png``."""
        with report_refusal():
            # The draft at initialisation; an FSDP2 root must run its first forward before its layers do.
            if self.runtime.global_step == 0 and self.acceptance.every_steps and self.parallel_strategy != "fsdp2":
                self._log_eval(self._untimed(self.acceptance.run, 0))
            super().run_train_validation_loop()
        self._export_last_checkpoint()
        if self.dist_env.is_main and (self.output_dir / "metrics.jsonl").exists():
            logger.info("training curves: %s", plot_training_curves(self.output_dir / "metrics.jsonl"))
        # Every rank leaves together, so none tears its process groups down (upstream's atexit
        # destroy_process_group) while rank 0 still draws: a gloo rank 1 that exited during the drawing
        # aborted at exit once in CI ("terminate called without an active exception"), its work all done.
        if dist.is_initialized():
            dist.barrier()

    def _export_last_checkpoint(self) -> None:
        """Rank 0 writes (or validates) the last checkpoint's ``model/consolidated/`` (``export.py``), once every
        rank has checked that rank 0 sees every rank's draft file (node-local checkpoint folders: refused)."""
        if not self.checkpointer.config.enabled:
            return
        latest = resolve_restore_from_to_checkpoint_dir(self.checkpoint_config.checkpoint_dir, "LATEST")
        with report_refusal():
            if dist.is_initialized() and dist.get_world_size() > 1:
                require_rank_files_on_rank0(pathlib.Path(latest) / "model" if latest is not None else None)
            if self.dist_env.is_main and latest is not None:
                logger.info("servable draft: %s", export_draft(pathlib.Path(latest)))
        if dist.is_initialized():
            dist.barrier()

    def _forward_batch(self, batch):
        """Upstream's step, plus running counts (all dp ranks) of real tokens, captured tokens (padding included),
        documents, supervised draft slots (block slots with a label) and a data checksum.

        Validation batches (``_run_eval``) are not counted.
        """
        if not self._counting_tokens:
            return self._draft_step(batch)
        ids = batch["input_ids"].to(torch.long)
        weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.long)
        checksum = int(((ids.cpu() * weights).sum(1) % 1_000_003).sum())
        seq_lens = batch.get("seq_lens")
        documents = (seq_lens > 0).sum() if seq_lens is not None else (batch["attention_mask"].sum(1) > 0).sum()
        metrics = self._draft_step(batch)
        # One all-reduce (and host read) carries the counters and whether any rank's loss is non-finite.
        on_device = torch.stack(
            [
                (~torch.isfinite(metrics.loss.detach())).to(torch.long),
                metrics.accept_rate_per_pos_den.sum().round().long(),
            ]
        ).cpu()
        counts = [int(batch["attention_mask"].sum()), checksum, int(ids.numel()), int(documents)]
        stats = torch.cat([torch.tensor(counts), on_device])
        tokens, checksum, captured, documents, bad_ranks, supervised = self._dp_allreduce(stats).tolist()
        if bad_ranks:
            step = self.runtime.global_step + 1
            raise FloatingPointError(
                f"non-finite DSpark loss at optimizer step {step} (epoch {self._epoch}) on {bad_ranks} data-parallel "
                "rank(s); stopped before its backward. Check the data and the target's captured features. "
                + resume_advice(
                    self.checkpoint_config.checkpoint_dir if self.checkpointer.config.enabled else None, step
                )
            )
        self._tokens_seen += int(tokens)
        self._captured_tokens += int(captured)
        self._documents += int(documents)
        self._supervised_slots += int(supervised)
        self._data_checksum = (self._data_checksum + int(checksum)) % 2**61
        self._trailing.add(metrics)
        self._micro_since_step += 1
        return metrics

    def _draft_step(self, batch):
        """Upstream's capture and draft step; under CP the CP-native one (``cp_trainer.py``).

        Each CP rank captures its shard, receives its halos from its neighbours and trains
        the anchors of its shard; no rank gathers the pack's features.
        """
        if self.target_wrapper.cp_mesh is None:
            return super()._forward_batch(batch)
        batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
        config = self._module().draft_model.config
        captured = self.target_wrapper.generate_shard_batch(
            batch["input_ids"],
            batch["loss_mask"],
            batch.get("position_ids"),
            batch.get("seq_lens"),
            batch.get("doc_remaining"),
            before=config.sliding_window,
            after=config.dspark_block_size,
        )
        return self.trainer_module(
            input_ids=captured.input_ids,
            target_hidden_states=captured.target_hidden_states,
            loss_mask=captured.loss_mask,
            target_last_hidden_states=captured.target_last_hidden_states,
            position_ids=captured.position_ids,
            seq_lens=captured.seq_lens,
            doc_remaining=captured.doc_remaining,
            shard=captured.shard,
        )

    def _save_extra_state(self, path: str, epoch: int) -> None:
        """Upstream's DSpark meta, the token and data-checksum counters (``progress_meta.pt``) and the
        run's effective config and launch folder (``run_record.py``)."""
        super()._save_extra_state(path, epoch)
        sharded = self.parallel_strategy == "fsdp2" and self.dist_env.world_size > 1
        save_run_record(self.cfg, path, draft_shard_files=self.dist_env.world_size if sharded else None)
        torch.save({**self._counters(), "tokens_seen": self._tokens_seen}, pathlib.Path(path) / "progress_meta.pt")

    def _load_extra_state(self, ckpt_dir: str) -> None:
        super()._load_extra_state(ckpt_dir)
        meta = pathlib.Path(ckpt_dir) / "progress_meta.pt"
        if meta.exists():
            state = torch.load(meta, map_location="cpu", weights_only=True)
            self._tokens_seen, self._data_checksum = int(state["tokens_seen"]), int(state["data_checksum"])
            # Checkpoints written before these counters existed restart them at 0.
            self._captured_tokens = int(state.get("captured_tokens", 0))
            self._documents = int(state.get("documents", 0))
            self._supervised_slots = int(state.get("supervised_slots", 0))

    def _counters(self) -> dict[str, int]:
        """The running counters each ``metrics.jsonl`` step record carries (all dp ranks, since step 0)."""
        return {
            "tokens": self._tokens_seen,
            "captured_tokens": self._captured_tokens,
            "documents": self._documents,
            "supervised_slots": self._supervised_slots,
            "data_checksum": self._data_checksum,
        }


__all__ = ["PackedDSparkLoopHooks"]
