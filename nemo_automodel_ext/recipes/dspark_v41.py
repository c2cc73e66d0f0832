"""Packed DSpark distillation of DeepSeek V4.1: ``TrainPackedDSparkV41Recipe``.

nemo_automodel 0.7.0's ``TrainDSparkRecipe`` refuses packing for the V4.1 draft and with
context parallelism, and its V4.1 target build needs CUDA. This recipe subclasses it and
replaces only ``setup`` (what gets built) and ``_forward_batch`` (token accounting); the
training loop, loss, metric window, checkpointing and resume are upstream's.

What it builds instead:

- the target through a builder: ``local`` (config + safetensors from a folder, any device,
  the CPU backend; the tiny CPU recipe) or ``automodel`` (upstream's
  ``DeepseekV41DSparkTargetConfig``: EP/FSDP on CUDA, TE/TileLang/HybridEP backends);
- the plugin's target wrapper (``DeepseekV41DSparkTargetModel``): packed batches go
  through ``dspark_packed_forward`` or, with ``distributed.cp_size > 1``, the CP shard;
- the plugin's packed draft (``DeepseekV41PackedDSparkModel``), validated by upstream's
  ``DeepseekV41DSparkConfig``;
- ``metrics.jsonl`` and one progress line per logged step with tokens/s and ETA
  (``progress.py``), W&B from the config's ``wandb:`` section as upstream's recipe does;
- exact greedy acceptance on the validation set every ``eval_every_steps`` and at each epoch's
  end (``acceptance_eval.py``), and ``training_curves.png`` at the end (``plots.py``).

Run it with the framework's CLI: ``automodel recipes/deepseek_v41/dspark_tiny_cpu.yaml``.
"""

from __future__ import annotations

import logging
import pathlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from nemo_automodel._transformers.auto_tokenizer import NeMoAutoTokenizer
from nemo_automodel.components.checkpoint.utils import resolve_restore_from_to_checkpoint_dir
from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_dataloader
from nemo_automodel.components.distributed.init_utils import initialize_distributed
from nemo_automodel.components.loggers.log_utils import setup_logging
from nemo_automodel.components.loggers.metric_logger import MetricsSample, build_metric_logger
from nemo_automodel.components.models.common.utils import cast_model_to_dtype
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.speculative.dspark.target_utils import (
    apply_target_chat_template,
)
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.recipes.llm._spec_train_utils import (
    apply_draft_activation_checkpointing,
    make_warmup_cosine_schedule,
    optim_steps_per_epoch,
)
from nemo_automodel.recipes.llm.train_dspark import (
    TrainDSparkRecipe,
    _build_dspark_optimizer,
    _init_dspark_wandb,
    _resolve_warmup_steps,
)
from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel_ext.export import export_draft
from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.dspark_target import compression_alignment
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend
from nemo_automodel_ext.quiet import quiet_sglang_warning
from nemo_automodel_ext.recipes.acceptance_eval import AcceptanceEvaluator
from nemo_automodel_ext.recipes.builders import (
    build_packed_draft,
    check_layout_memory,
    check_target_contract,
    frozen_target_setup,
    load_local_target,
    require_target_path,
    require_v41_checkpoint,
)
from nemo_automodel_ext.recipes.config import section_get, validate_recipe_config
from nemo_automodel_ext.recipes.data_checks import check_recipe_data, require_a_batch_per_rank
from nemo_automodel_ext.recipes.parallel import draft_mesh, parallelize_draft
from nemo_automodel_ext.recipes.plots import plot_training_curves
from nemo_automodel_ext.recipes.progress import ProgressMetricLogger, TrailingWindow, quiet_upstream_step_lines
from nemo_automodel_ext.recipes.refusals import report_refusal
from nemo_automodel_ext.recipes.resume import ResumedEpochLoader, resume_advice
from nemo_automodel_ext.recipes.run_record import save_run_pointer, save_run_record
from nemo_automodel_ext.registry import resolve_dspark_target_wrapper

logger = logging.getLogger(__name__)


class TrainPackedDSparkV41Recipe(TrainDSparkRecipe):
    """Packed (and context-parallel) DSpark training with a DeepSeek V4.1 target and draft."""

    def setup(self) -> None:
        """Build meshes, target, wrapper, data, draft, optimizer and checkpointer (refusals: ``refusals.py``)."""
        with report_refusal():
            self._setup()

    def _setup(self) -> None:
        dist_cfg = self.cfg.get("dist_env", {})
        self.dist_env = initialize_distributed(
            backend=dist_cfg.get("backend", "nccl"), timeout_minutes=dist_cfg.get("timeout_minutes", 30)
        )
        setup_logging()
        self.device = self.dist_env.device or torch.device("cpu")
        world_size = self.dist_env.world_size
        args = validate_recipe_config(self.cfg, world_size, self.device.type)
        self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.cached_target_path = None
        self.packed_sequence_size = int(args["packed_sequence_size"] or 0)

        if args["tiny_assets_dir"] is not None:
            self._prepare_tiny_assets(args["tiny_assets_dir"])
        target_path = str(args["target_model_name_or_path"])
        require_target_path(target_path, str(args["target_builder"]))
        if args["target_builder"] == "local":
            quiet_sglang_warning()  # a local (demo/test) target is never served on SGLang
        require_v41_checkpoint(target_path, bool(args["trust_remote_code"]))
        check_target_contract(target_path, args)
        if args["target_builder"] == "automodel" and self.device.type == "cuda":
            gpu_gib = torch.cuda.get_device_properties(self.device).total_memory / 2**30
            check_layout_memory(self.cfg, args, target_path, world_size, gpu_gib)

        distributed = self.cfg.get("distributed", None)
        cp_size = int(section_get(distributed, "cp_size", 1) or 1)
        self.device_mesh = self.distributed_setup = self.cp_mesh = self.dp_mesh = None
        if cp_size > 1:
            self.device_mesh = init_device_mesh(
                self.device.type, (world_size // cp_size, cp_size), mesh_dim_names=("dp", "cp")
            )
            self.cp_mesh, self.dp_mesh = self.device_mesh["cp"], self.device_mesh["dp"]

        self.tokenizer = NeMoAutoTokenizer.from_pretrained(
            target_path, trust_remote_code=bool(args["trust_remote_code"])
        )
        apply_target_chat_template(self.tokenizer, args["chat_template"])

        self.target_model = self._build_target(args, target_path)
        text = self.target_model.config.text_config
        self.target_layer_ids = list(args["target_layer_ids"] or text.dspark_target_layer_ids)
        architectures = list(self.target_model.config.architectures or ["DeepseekV41ForCausalLM"])
        wrapper_cls = resolve_dspark_target_wrapper(architectures)
        if not issubclass(wrapper_cls, DeepseekV41DSparkTargetModel):
            raise ValueError(f"no packed DSpark target wrapper is registered for {architectures}; reinstall the plugin")
        self.target_wrapper = wrapper_cls(self.target_model, self.target_layer_ids, cp_mesh=self.cp_mesh)
        if self.dist_env.is_main:
            logger.info(
                "V4.1 target: %d layers, packed alignment %d (LCM of active compression ratios), dispatcher %s, cp %d",
                text.num_hidden_layers,
                compression_alignment(self.target_model),
                self.target_model.backend.dispatcher,
                cp_size,
            )

        self.block_size = int(args["block_size"] or text.dspark_block_size)
        self.num_anchors = int(args["num_anchors"])
        self.mask_token_id = self._resolve_mask_token_id(self.cfg.recipe_args, text.vocab_size)
        check_recipe_data(args, self.tokenizer, self.packed_sequence_size or int(args["seq_length"]), text.vocab_size)
        self.train_dataloader = self._build_dataloader(args, args["train_data_path"], args["train_split"], True)
        self.val_dataloader = (
            self._build_dataloader(args, args["val_data_path"], args["val_split"], False)
            if args["val_data_path"]
            else None
        )
        require_a_batch_per_rank(
            args, len(self.train_dataloader.dataset), self.dp_mesh.size() if self.dp_mesh is not None else world_size
        )

        torch.manual_seed(int(args["shuffle_seed"]))  # identical draft initialisation on every rank
        self.draft_model = self._build_draft(args, text, architectures).to(self.device)
        cast_model_to_dtype(self.draft_model, self.compute_dtype)
        embed_tokens, lm_head = self.target_wrapper.get_input_embeddings(), self.target_wrapper.get_output_embeddings()
        if self.distributed_setup is not None:
            # The EP/FSDP-loaded target holds DTensor shards; the draft copies full weights.
            from nemo_automodel.recipes.llm._dspark_target_build import gather_full_weight_module

            embed_tokens, lm_head = gather_full_weight_module(embed_tokens), gather_full_weight_module(lm_head)
        self.draft_model.initialize_embeddings_and_head(
            embed_tokens=embed_tokens, lm_head=lm_head, freeze=bool(args["freeze_embeddings"])
        )
        # Upstream's setup wraps the draft's layers; the frozen target has no backward to save memory in.
        apply_draft_activation_checkpointing(
            self.draft_model, section_get(distributed, "activation_checkpointing", False) or False
        )
        trainer_module = PackedDSparkTrainerModule(
            self.draft_model,
            loss_decay_gamma=args["loss_decay_gamma"],
            ce_loss_alpha=float(args["ce_loss_alpha"]),
            l1_loss_alpha=float(args["l1_loss_alpha"]),
            confidence_head_alpha=float(args["confidence_head_alpha"]),
        ).to(self.device)
        self.parallel_strategy = str(section_get(distributed, "strategy", "ddp")).lower() if world_size > 1 else "ddp"
        # CP-native: every rank trains its shard's anchors, so the draft is one model over dp x cp.
        self.draft_mesh = draft_mesh(self.device_mesh)
        self.trainer_module = parallelize_draft(
            trainer_module, self.parallel_strategy, world_size, self.device, self.draft_mesh, self.compute_dtype
        )
        self._precompute_fp8_scales = False

        opt_cfg = self.cfg.optimizer
        self.peak_lr = float(opt_cfg.lr)
        self.optimizer = _build_dspark_optimizer(self.trainer_module, opt_cfg, device_mesh=self.draft_mesh)
        self.grad_accumulation_steps = int(args["grad_accumulation_steps"])
        self.max_grad_norm = args["max_grad_norm"]
        self.num_epochs = int(args["num_epochs"])
        self.log_every_steps = int(args["log_every_steps"])
        self.ckpt_every_steps = args["ckpt_every_steps"]
        self.save_checkpoint_every_epoch = bool(args["save_checkpoint_every_epoch"])
        self.output_dir = pathlib.Path(args["output_dir"])
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.dist_env.is_main:
            save_run_pointer(self.output_dir, section_get(self.cfg.get("checkpoint", None), "checkpoint_dir", None))
        # False (the plugin's default): FSDP2 reduce-scatters every micro-batch into sharded gradients, so
        # accumulation holds no unsharded fp32 draft gradients (docs/scaling.md, "Gradient accumulation").
        self.defer_fsdp_grad_sync = bool(args["defer_fsdp_grad_sync"])
        batches = len(self.train_dataloader)
        self.total_optim_steps = max(1, self.num_epochs * optim_steps_per_epoch(batches, self.grad_accumulation_steps))
        warmup_steps = _resolve_warmup_steps(float(opt_cfg.get("warmup_ratio", 0.05)), self.total_optim_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            make_warmup_cosine_schedule(warmup_steps, self.total_optim_steps, float(opt_cfg.get("min_lr_ratio", 0.1))),
        )
        self.runtime = SimpleNamespace(global_step=0)
        self._resume_epoch = 0
        self._tokens_seen = 0
        self._data_checksum = 0
        self.rng = StatefulRNG(seed=int(args["shuffle_seed"]) + self._get_dp_rank(), ranked=False)
        self._build_checkpointer(target_path)
        if self.cp_mesh is not None:
            # CP peers share a dp rank, like TP peers: every rank enters save_on_dp_ranks (it
            # barriers over all ranks) and only the first CP peer writes the shared RNG file.
            # Upstream lets only that peer enter, which deadlocks the barrier; the wrapper keeps
            # its own reference to the CP mesh.
            self.checkpointer.tp_rank = self.cp_mesh.get_local_rank()
            self.cp_mesh = None
        self.load_checkpoint(self.cfg.get("checkpoint.restore_from", None))
        self._trailing, self._micro_since_step = TrailingWindow(self.block_size, self.device), 0
        self.train_dataloader = ResumedEpochLoader(
            self.train_dataloader, self._consumed_batches_in_epoch(batches), on_epoch_start=self._trailing.reset
        )
        # Upstream's loop logs on the main rank only; the other ranks keep no metric files open.
        self.metric_logger = (
            ProgressMetricLogger(
                self.output_dir / "metrics.jsonl",
                self.total_optim_steps,
                lambda: {"tokens": self._tokens_seen, "data_checksum": self._data_checksum},
                inner=build_metric_logger(str(self.output_dir / "dspark_train_metrics.jsonl")),
                start_step=self.runtime.global_step,
            )
            if self.dist_env.is_main
            else None
        )
        self.wandb_run = _init_dspark_wandb(
            is_main=self.dist_env.is_main,
            wandb_cfg=self.cfg.get("wandb", None),
            cfg_dict=self.cfg.to_dict(),
            default_name="dspark_" + target_path.rstrip("/").split("/")[-1],
        )
        quiet_upstream_step_lines()
        self._counting_tokens, self._epoch = True, self._resume_epoch
        self.acceptance = AcceptanceEvaluator(
            self.target_wrapper,
            lambda: self._module().draft_model,
            self.val_dataloader,
            args["eval_every_steps"],
            root=self.trainer_module,
            all_reduce=self._dp_allreduce,
            is_main=self.dist_env.is_main,
        )
        if self.dist_env.is_main:
            logger.info(
                "DSpark V4.1: %d optimizer steps (%d epochs x %d batches), packed_sequence_size=%d, output %s",
                self.total_optim_steps,
                self.num_epochs,
                batches,
                self.packed_sequence_size,
                self.output_dir,
            )

    def _prepare_tiny_assets(self, directory: str) -> None:
        from nemo_automodel_ext.recipes.tiny_assets import ensure_tiny_assets

        if self.dist_env.is_main:
            ensure_tiny_assets(directory)
        if dist.is_initialized():
            dist.barrier()

    def _build_target(self, args: dict[str, Any], target_path: str) -> DeepseekV41ForCausalLM:
        if args["target_builder"] == "local":
            backend = cpu_backend(
                attn=args["target_attn_backend"], dispatcher=args["target_dispatcher"], experts=args["target_experts"]
            )
            return load_local_target(target_path, backend, self.device, self.compute_dtype)
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41DSparkTargetConfig

        options = DeepseekV41DSparkTargetConfig(
            target_path=target_path,
            trust_remote_code=bool(args["trust_remote_code"]),
            attn_backend=str(args["target_attn_backend"]),
            dispatcher=str(args["target_dispatcher"]),
            experts=str(args["target_experts"]),
            enable_fsdp_optimizations=bool(args["target_enable_fsdp_optimizations"]),
        )
        self.distributed_setup = frozen_target_setup(self.cfg, self.dist_env.world_size)
        model = options.build(
            device=self.device, compute_dtype=self.compute_dtype, distributed_setup=self.distributed_setup
        )
        return model.eval().requires_grad_(False)

    def _build_dataloader(self, args: dict[str, Any], path: str, split: str | None, train: bool):
        return build_eagle3_dataloader(
            data_path=path,
            tokenizer=self.tokenizer,
            seq_length=int(args["seq_length"]),
            batch_size=int(args["micro_batch_size"]),
            shuffle=train,
            num_workers=int(args["num_workers"]),
            split=split,
            # A DistributedSampler even on one rank: its order depends on (seed, epoch) only, which
            # is what lets a resumed run continue an epoch exactly where the checkpoint left it.
            distributed=dist.is_initialized(),
            shuffle_seed=args["shuffle_seed"],
            mask_reasoning_content=bool(args["mask_reasoning_content"]),
            mask_generation_prompt=bool(args["mask_generation_prompt"]),
            packed_sequence_size=self.packed_sequence_size,
            dp_mesh=self.dp_mesh,
        )

    def _build_draft(self, args: dict[str, Any], text, architectures: list[str]) -> DeepseekV41PackedDSparkModel:
        return build_packed_draft(
            args, text, architectures, self.target_layer_ids, self.block_size, self.num_anchors, self.mask_token_id
        )

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
            self._log_eval(self.acceptance.run(self.runtime.global_step))
        return saved

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
            metrics = super()._run_eval()
        finally:
            self._counting_tokens = True
        if metrics is None:
            return None
        metrics.update(self.acceptance.run(self.runtime.global_step))
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
                self._log_eval(self.acceptance.run(0))
            super().run_train_validation_loop()
        self._export_last_checkpoint()
        if self.dist_env.is_main and (self.output_dir / "metrics.jsonl").exists():
            logger.info("training curves: %s", plot_training_curves(self.output_dir / "metrics.jsonl"))

    def _export_last_checkpoint(self) -> None:
        """Rank 0 writes the last checkpoint's ``model/consolidated/`` when the save left none (``export.py``)."""
        if not self.checkpointer.config.enabled:
            return
        if self.dist_env.is_main:
            latest = resolve_restore_from_to_checkpoint_dir(self.checkpoint_config.checkpoint_dir, "LATEST")
            if latest is not None:
                logger.info("servable draft: %s", export_draft(pathlib.Path(latest)))
        if dist.is_initialized():
            dist.barrier()

    def _forward_batch(self, batch):
        """Upstream's step, plus running counts of real tokens and a data checksum (all dp ranks).

        Validation batches (``_run_eval``) are not counted.
        """
        if not self._counting_tokens:
            return self._draft_step(batch)
        ids = batch["input_ids"].to(torch.long)
        weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.long)
        checksum = int(((ids.cpu() * weights).sum(1) % 1_000_003).sum())
        metrics = self._draft_step(batch)
        # One all-reduce (and host read) carries the counters and whether any rank's loss is non-finite.
        nonfinite = (~torch.isfinite(metrics.loss.detach())).to(torch.long).reshape(1).cpu()
        stats = torch.cat([torch.tensor([int(batch["attention_mask"].sum()), checksum]), nonfinite])
        tokens, checksum, bad_ranks = self._dp_allreduce(stats).tolist()
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
        save_run_record(self.cfg, path)
        torch.save(
            {"tokens_seen": self._tokens_seen, "data_checksum": self._data_checksum},
            pathlib.Path(path) / "progress_meta.pt",
        )

    def _load_extra_state(self, ckpt_dir: str) -> None:
        super()._load_extra_state(ckpt_dir)
        meta = pathlib.Path(ckpt_dir) / "progress_meta.pt"
        if meta.exists():
            state = torch.load(meta, map_location="cpu", weights_only=True)
            self._tokens_seen, self._data_checksum = int(state["tokens_seen"]), int(state["data_checksum"])


__all__ = ["TrainPackedDSparkV41Recipe"]
