"""Packed DSpark distillation of DeepSeek V4.1: ``TrainPackedDSparkV41Recipe``.

nemo_automodel 0.7.0's ``TrainDSparkRecipe`` refuses packing for the V4.1 draft and with
context parallelism, and its V4.1 target build needs CUDA. This recipe subclasses it and
replaces ``setup`` (what gets built, here) and some of the loop's hooks (``loop_hooks.py``:
token accounting, evaluation, the end-of-run export); the training loop, loss, metric
window, checkpointing and resume are upstream's.

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

import functools
import logging
import pathlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from nemo_automodel._transformers.auto_tokenizer import NeMoAutoTokenizer
from nemo_automodel.components.distributed.init_utils import initialize_distributed
from nemo_automodel.components.loggers.log_utils import setup_logging
from nemo_automodel.components.loggers.metric_logger import build_metric_logger
from nemo_automodel.components.models.common.utils import cast_model_to_dtype
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.speculative.dspark.target_utils import (
    apply_target_chat_template,
)
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.recipes.llm._spec_train_utils import (
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

from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.dspark_target import compression_alignment
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend
from nemo_automodel_ext.quiet import quiet_sglang_warning
from nemo_automodel_ext.recipes.acceptance_eval import AcceptanceEvaluator
from nemo_automodel_ext.recipes.builders import check_layout_memory, frozen_target_setup
from nemo_automodel_ext.recipes.loop_hooks import PackedDSparkLoopHooks
from nemo_automodel_ext.recipes.parallel import draft_mesh, expert_mesh, parallelize_draft
from nemo_automodel_ext.recipes.progress import ProgressMetricLogger, TrailingWindow, quiet_upstream_step_lines
from nemo_automodel_ext.recipes.refusals import report_refusal
from nemo_automodel_ext.recipes.resume import ResumedEpochLoader, batches_in_epoch
from nemo_automodel_ext.registry import resolve_dspark_target_wrapper
from nemo_automodel_ext.run.batching import build_recipe_dataloader
from nemo_automodel_ext.run.config import section_get, validate_recipe_config
from nemo_automodel_ext.run.data_checks import check_recipe_data, require_a_batch_per_rank
from nemo_automodel_ext.run.loading import (
    build_packed_draft,
    check_target_contract,
    load_local_target,
    require_target_path,
    require_v41_checkpoint,
)
from nemo_automodel_ext.run.paths import require_run_folders
from nemo_automodel_ext.run.run_record import save_run_pointer

logger = logging.getLogger(__name__)


class TrainPackedDSparkV41Recipe(PackedDSparkLoopHooks, TrainDSparkRecipe):
    """Packed (and context-parallel) DSpark training with a DeepSeek V4.1 target and draft.

    ``setup`` builds everything (below); the loop is upstream's, with the hooks of ``loop_hooks.py``.
    """

    def setup(self) -> None:
        """Build meshes, target, wrapper, data, draft, optimizer and checkpointer (refusals: ``refusals.py``)."""
        with report_refusal():
            self._setup()

    def _setup(self) -> None:
        args, target_path = self._setup_environment()
        self._setup_target(args, target_path)
        self._setup_data(args)
        self._setup_draft(args)
        self._setup_optimization(args)
        self._setup_run(args, target_path)

    def _setup_environment(self) -> tuple[dict[str, Any], str]:
        """Process group, device, validated ``recipe_args``, the target's checks; returns (args, target path)."""
        dist_cfg = self.cfg.get("dist_env", {})
        self.dist_env = initialize_distributed(
            backend=dist_cfg.get("backend", "nccl"), timeout_minutes=dist_cfg.get("timeout_minutes", 30)
        )
        setup_logging()
        self.device = self.dist_env.device or torch.device("cpu")
        world_size = self.dist_env.world_size
        args = validate_recipe_config(self.cfg, world_size, self.device.type)
        require_run_folders(self.cfg, args)  # before the target loads: a bad folder would surface at the first save
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
        return args, target_path

    def _setup_target(self, args: dict[str, Any], target_path: str) -> None:
        """CP meshes, tokenizer, the frozen target and its packed wrapper."""
        world_size = self.dist_env.world_size
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

    def _setup_data(self, args: dict[str, Any]) -> None:
        """Block, anchors and mask token, the data checks and the train and validation loaders."""
        text = self.target_model.config.text_config
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
            args,
            len(self.train_dataloader.dataset),
            self.dp_mesh.size() if self.dp_mesh is not None else self.dist_env.world_size,
        )

    def _setup_draft(self, args: dict[str, Any]) -> None:
        """The packed draft (identical on every rank), its loss module, parallelised over dp x cp."""
        world_size = self.dist_env.world_size
        distributed = self.cfg.get("distributed", None)
        text = self.target_model.config.text_config
        architectures = list(self.target_model.config.architectures or ["DeepseekV41ForCausalLM"])
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
        trainer_module = PackedDSparkTrainerModule(
            self.draft_model,
            loss_decay_gamma=args["loss_decay_gamma"],
            ce_loss_alpha=float(args["ce_loss_alpha"]),
            l1_loss_alpha=float(args["l1_loss_alpha"]),
            confidence_head_alpha=float(args["confidence_head_alpha"]),
        ).to(self.device)
        self.parallel_strategy = str(section_get(distributed, "strategy", "ddp")).lower() if world_size > 1 else "ddp"
        # CP-native: every rank trains its shard's anchors, so the draft is one model over dp x cp;
        # with draft_ep_size > 1 its routed experts are spread over groups of that many ranks.
        self.draft_mesh = draft_mesh(self.device_mesh)
        ep_size = int(args["draft_ep_size"])
        if text.dspark_n_routed_experts % ep_size:
            raise ValueError(
                f"recipe_args.draft_ep_size={ep_size} must divide the draft's {text.dspark_n_routed_experts} "
                "routed experts (dspark_n_routed_experts of the target's config)"
            )
        self.draft_expert_mesh = expert_mesh(self.device.type, world_size, ep_size) if ep_size > 1 else None
        self.trainer_module = parallelize_draft(
            trainer_module,
            self.parallel_strategy,
            world_size,
            self.device,
            self.draft_mesh,
            self.compute_dtype,
            experts=self.draft_expert_mesh,
            dispatcher=str(args["draft_ep_dispatcher"]),
            # Upstream's draft checkpointing, after expert parallelism (upstream's order; parallel.parallelize_draft);
            # the frozen target has no backward to save memory in.
            activation_checkpointing=section_get(distributed, "activation_checkpointing", False) or False,
        )
        self._precompute_fp8_scales = False

    def _setup_optimization(self, args: dict[str, Any]) -> None:
        """Optimizer, schedule, accumulation and the step, log and checkpoint cadence."""
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
        steps_per_epoch = optim_steps_per_epoch(batches, self.grad_accumulation_steps)
        # max_steps: the run stops after that many optimizer steps, inside an epoch if it falls there (the loader
        # stops with it: resume.batches_in_epoch), and the schedule is planned for the steps the run trains.
        self.max_steps = args["max_steps"]
        if self.max_steps is not None and self.max_steps < self.num_epochs * steps_per_epoch:
            self.num_epochs = -(-self.max_steps // steps_per_epoch)
        steps = self.num_epochs * steps_per_epoch
        self.total_optim_steps = max(1, steps if self.max_steps is None else min(steps, self.max_steps))
        warmup_steps = _resolve_warmup_steps(float(opt_cfg.get("warmup_ratio", 0.05)), self.total_optim_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            make_warmup_cosine_schedule(warmup_steps, self.total_optim_steps, float(opt_cfg.get("min_lr_ratio", 0.1))),
        )

    def _setup_run(self, args: dict[str, Any], target_path: str) -> None:
        """Checkpointer and resume, the metric files and W&B, the acceptance evaluator."""
        batches = len(self.train_dataloader)
        self.runtime = SimpleNamespace(global_step=0)
        self._resume_epoch = 0
        self._tokens_seen = self._captured_tokens = self._documents = self._supervised_slots = 0
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
            self.train_dataloader,
            self._consumed_batches_in_epoch(batches),
            on_epoch_start=self._trailing.reset,
            epoch=self._resume_epoch,
            batches_in_epoch=functools.partial(
                batches_in_epoch,
                batches=batches,
                grad_accumulation_steps=self.grad_accumulation_steps,
                max_steps=self.max_steps,
            ),
        )
        # Upstream's loop logs on the main rank only; the other ranks keep no metric files open.
        self.metric_logger = (
            ProgressMetricLogger(
                self.output_dir / "metrics.jsonl",
                self.total_optim_steps,
                self._counters,
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
        from nemo_automodel_ext.demo.tiny_assets import ensure_tiny_assets

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
        """Training batches as ``recipe_args.batching`` names, held-out prompts packed alike for every batching
        (``run/batching.py``)."""
        return build_recipe_dataloader(args, self.tokenizer, path, split, train, self.dp_mesh)

    def _build_draft(self, args: dict[str, Any], text, architectures: list[str]) -> DeepseekV41PackedDSparkModel:
        return build_packed_draft(
            args, text, architectures, self.target_layer_ids, self.block_size, self.num_anchors, self.mask_token_id
        )


__all__ = ["TrainPackedDSparkV41Recipe"]
