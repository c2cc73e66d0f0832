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
- ``metrics.jsonl`` and progress lines with tokens/s and ETA (``progress.py``).

Run it with the framework's CLI: ``automodel recipes/deepseek_v41/dspark_tiny_cpu.yaml``.
"""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import logging
import pathlib
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from nemo_automodel._transformers.auto_tokenizer import NeMoAutoTokenizer
from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_dataloader
from nemo_automodel.components.distributed.init_utils import initialize_distributed
from nemo_automodel.components.loggers.log_utils import setup_logging
from nemo_automodel.components.loggers.metric_logger import build_metric_logger
from nemo_automodel.components.models.common.utils import cast_model_to_dtype
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41DSparkConfig
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule
from nemo_automodel.components.speculative.dspark.target_utils import (
    DEEPSEEK_V41_MODEL_TYPE,
    apply_target_chat_template,
    read_target_model_type,
)
from nemo_automodel.components.training.rng import StatefulRNG
from nemo_automodel.recipes.llm._spec_train_utils import make_warmup_cosine_schedule, optim_steps_per_epoch
from nemo_automodel.recipes.llm.train_dspark import (
    TrainDSparkRecipe,
    _build_dspark_optimizer,
    _resolve_warmup_steps,
)
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.dspark_target import compression_alignment
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend
from nemo_automodel_ext.recipes.progress import ProgressMetricLogger
from nemo_automodel_ext.registry import resolve_dspark_draft, resolve_dspark_target_wrapper

logger = logging.getLogger(__name__)

#: Every recipe_args key this recipe reads, with its default (None: required or optional).
RECIPE_ARGS: dict[str, Any] = {
    "target_model_name_or_path": None,
    "tiny_assets_dir": None,
    "trust_remote_code": False,
    "target_builder": "automodel",
    "target_attn_backend": "tilelang",
    "target_dispatcher": "hybridep",
    "target_experts": "torch_mm",
    "target_enable_fsdp_optimizations": True,
    "draft_attn_backend": "sdpa",
    "chat_template": None,
    "train_data_path": None,
    "val_data_path": None,
    "train_split": None,
    "val_split": None,
    "seq_length": None,
    "packed_sequence_size": 0,
    "micro_batch_size": 1,
    "num_workers": 0,
    "num_epochs": 1,
    "shuffle_seed": 42,
    "mask_reasoning_content": False,
    "mask_generation_prompt": False,
    "draft_num_hidden_layers": None,
    "target_layer_ids": None,
    "block_size": None,
    "num_anchors": 512,
    "mask_token_id": None,
    "markov_rank": None,
    "markov_head_type": "vanilla",
    "confidence_head_alpha": 1.0,
    "confidence_head_with_markov": True,
    "confidence_head_stop_gradient": False,
    "freeze_embeddings": True,
    "loss_decay_gamma": None,
    "ce_loss_alpha": 0.1,
    "l1_loss_alpha": 0.9,
    "grad_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "log_every_steps": 10,
    "ckpt_every_steps": None,
    "save_checkpoint_every_epoch": False,
    "output_dir": None,
}
TARGET_BUILDERS = ("local", "automodel")


def _get(section: Any, key: str, default: Any = None) -> Any:
    return section.get(key, default) if section is not None else default


def validate_recipe_config(
    cfg: Any, world_size: int, device_type: str, require_packages: bool = True
) -> dict[str, Any]:
    """Check a packed V4.1 DSpark config before anything is built.

    Args:
        cfg: The loaded ``ConfigNode``.
        world_size: Number of ranks of the run.
        device_type: ``"cuda"`` or ``"cpu"``.
        require_packages: Also check that optional packages the config needs (HybridEP) import.

    Returns:
        ``recipe_args`` as a plain dict with defaults filled in.

    Raises:
        ValueError: naming the key and what to change: unknown keys, missing required keys,
            impossible parallel sizes, a dispatcher or backend that cannot run here.
    """
    section = cfg.get("recipe_args", None)
    if section is None:
        raise ValueError("the config needs a recipe_args section")
    raw = section.to_dict() if hasattr(section, "to_dict") else dict(section)
    unknown = sorted(set(raw) - set(RECIPE_ARGS))
    if unknown:
        hints = [
            f"{key} (did you mean {match[0]}?)" if (match := difflib.get_close_matches(key, RECIPE_ARGS, 1)) else key
            for key in unknown
        ]
        raise ValueError(f"unknown recipe_args keys: {', '.join(hints)}")
    args = {**RECIPE_ARGS, **raw}
    for key in ("target_model_name_or_path", "train_data_path", "seq_length", "output_dir", "mask_token_id"):
        if args[key] is None:
            raise ValueError(f"recipe_args.{key} is required")
    if args["target_builder"] not in TARGET_BUILDERS:
        raise ValueError(f"recipe_args.target_builder must be one of {TARGET_BUILDERS}, got {args['target_builder']!r}")
    if args["target_builder"] == "automodel" and device_type != "cuda":
        raise ValueError(
            "recipe_args.target_builder=automodel loads the target with EP/FSDP and needs CUDA; "
            "on CPU use target_builder: local with a CPU backend (target_attn_backend: eager, target_dispatcher: torch)"
        )
    packed = int(args["packed_sequence_size"] or 0)
    if packed < 0 or (packed and packed > int(args["seq_length"])):
        raise ValueError(
            f"recipe_args.packed_sequence_size must be 0 (off) or in [1, seq_length={args['seq_length']}], got {packed}"
        )
    distributed = cfg.get("distributed", None)
    cp_size = int(_get(distributed, "cp_size", 1) or 1)
    for axis in ("tp_size", "pp_size"):
        if int(_get(distributed, axis, 1) or 1) != 1:
            raise ValueError(f"distributed.{axis} must be 1 for DSpark (one non-pipelined target forward per rank)")
    if cp_size < 1 or world_size % cp_size:
        raise ValueError(f"distributed.cp_size={cp_size} must divide the number of ranks ({world_size})")
    if cp_size > 1 and not packed:
        raise ValueError("distributed.cp_size > 1 needs packed batches: set recipe_args.packed_sequence_size > 0")
    if cp_size > 1 and int(args["seq_length"]) < cp_size:
        raise ValueError(f"recipe_args.seq_length={args['seq_length']} is shorter than distributed.cp_size={cp_size}")
    dispatcher = args["target_dispatcher"]
    if dispatcher == "hybridep":
        if device_type != "cuda":
            raise ValueError(
                "target_dispatcher=hybridep needs CUDA GPUs; on CPU set recipe_args.target_dispatcher: torch"
            )
        if require_packages and importlib.util.find_spec("deep_ep") is None:
            raise ValueError(
                "target_dispatcher=hybridep needs the HybridEP package (deep_ep with HybridEPBuffer); install it or "
                "set recipe_args.target_dispatcher: deepep or torch"
            )
    if device_type != "cuda" and args["target_attn_backend"] == "tilelang":
        raise ValueError("target_attn_backend=tilelang needs CUDA; on CPU set recipe_args.target_attn_backend: eager")
    strategy = str(_get(distributed, "strategy", "ddp")).lower()
    if strategy not in ("ddp", "fsdp2"):
        raise ValueError(f"distributed.strategy must be ddp or fsdp2, got {strategy!r}")
    return args


def require_v41_checkpoint(path: str, trust_remote_code: bool = False) -> None:
    """Raise a ValueError unless ``path`` holds a DeepSeek V4.1 config (``model_type`` deepseek_v41)."""
    model_type = read_target_model_type(path, trust_remote_code)
    if model_type != DEEPSEEK_V41_MODEL_TYPE:
        raise ValueError(
            f"recipe_args.target_model_name_or_path must be a DeepSeek V4.1 checkpoint "
            f"(model_type {DEEPSEEK_V41_MODEL_TYPE!r}), got model_type {model_type!r} at {path}; "
            "use nemo_automodel.recipes.llm.train_dspark.TrainDSparkRecipe for other targets"
        )


def load_local_target(path: str | pathlib.Path, backend, device: torch.device, dtype: torch.dtype):
    """Build a V4.1 target from ``config.json`` + ``model.safetensors`` in ``path`` (no hub access).

    Args:
        path: Folder written by ``config.save_pretrained`` and ``safetensors.save_file``.
        backend: ``BackendConfig`` of the target.
        device: Device to place the target on.
        dtype: Parameter dtype of the frozen target.

    Returns:
        The frozen ``DeepseekV41ForCausalLM`` in eval mode.
    """
    path = pathlib.Path(path)
    config = DeepseekV41Config.from_pretrained(path, vision_config={"num_hidden_layers": 0})
    model = DeepseekV41ForCausalLM(config, backend=backend)
    missing, unexpected = model.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}/model.safetensors does not match its config: missing {missing}, unexpected {unexpected}"
        )
    cast_model_to_dtype(model, dtype)
    return model.to(device).eval().requires_grad_(False)


def build_packed_draft(
    args: dict[str, Any],
    text,
    architectures: list[str],
    target_layer_ids: list[int],
    block_size: int,
    num_anchors: int,
    mask_token_id: int,
) -> DeepseekV41PackedDSparkModel:
    """Build the registered packed draft for ``architectures`` from validated recipe args.

    Upstream's ``DeepseekV41DSparkConfig`` checks the recipe against the target's released
    DSpark contract first (draft depth, block size, mask token, Markov rank, feature layers).

    Args:
        args: ``validate_recipe_config`` output.
        text: The target's ``DeepseekV41TextConfig``.
        architectures: The target's HF architectures, for the draft registry.
        target_layer_ids: Feature layers of the target.
        block_size: Draft block size.
        num_anchors: Anchor blocks per row.
        mask_token_id: Token filling non-anchor block slots.

    Returns:
        A new draft (on the current default device).
    """
    options = DeepseekV41DSparkConfig(
        text_config=text,
        num_draft_layers=int(args["draft_num_hidden_layers"] or text.num_nextn_predict_layers),
        target_layer_ids=tuple(target_layer_ids),
        block_size=block_size,
        num_anchors=num_anchors,
        mask_token_id=mask_token_id,
        markov_rank=int(args["markov_rank"] or text.dspark_markov_rank),
        markov_head_type=str(args["markov_head_type"]),
        confidence_head_alpha=float(args["confidence_head_alpha"]),
        confidence_head_with_markov=bool(args["confidence_head_with_markov"]),
        confidence_head_stop_gradient=bool(args["confidence_head_stop_gradient"]),
    )
    draft_cls = resolve_dspark_draft(architectures)
    if not issubclass(draft_cls, DeepseekV41PackedDSparkModel):
        raise ValueError(f"no packed DSpark draft is registered for {architectures}; reinstall the plugin")
    return draft_cls.from_options(options, backend=cpu_backend(attn=str(args["draft_attn_backend"]), experts="torch"))


class TrainPackedDSparkV41Recipe(TrainDSparkRecipe):
    """Packed (and context-parallel) DSpark training with a DeepSeek V4.1 target and draft."""

    def setup(self) -> None:
        """Build meshes, target, wrapper, data, draft, optimizer and checkpointer."""
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
        require_v41_checkpoint(target_path, bool(args["trust_remote_code"]))

        distributed = self.cfg.get("distributed", None)
        cp_size = int(_get(distributed, "cp_size", 1) or 1)
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
        self.train_dataloader = self._build_dataloader(args, args["train_data_path"], args["train_split"], True)
        self.val_dataloader = (
            self._build_dataloader(args, args["val_data_path"], args["val_split"], False)
            if args["val_data_path"]
            else None
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
        trainer_module = DSparkTrainerModule(
            self.draft_model,
            loss_decay_gamma=args["loss_decay_gamma"],
            ce_loss_alpha=float(args["ce_loss_alpha"]),
            l1_loss_alpha=float(args["l1_loss_alpha"]),
            confidence_head_alpha=float(args["confidence_head_alpha"]),
        ).to(self.device)
        self.parallel_strategy = str(_get(distributed, "strategy", "ddp")).lower() if world_size > 1 else "ddp"
        self.trainer_module = self._parallelize(trainer_module, world_size)
        self._precompute_fp8_scales = False

        opt_cfg = self.cfg.optimizer
        self.peak_lr = float(opt_cfg.lr)
        self.optimizer = _build_dspark_optimizer(self.trainer_module, opt_cfg, device_mesh=self.dp_mesh)
        self.grad_accumulation_steps = int(args["grad_accumulation_steps"])
        self.max_grad_norm = args["max_grad_norm"]
        self.num_epochs = int(args["num_epochs"])
        self.log_every_steps = int(args["log_every_steps"])
        self.ckpt_every_steps = args["ckpt_every_steps"]
        self.save_checkpoint_every_epoch = bool(args["save_checkpoint_every_epoch"])
        self.output_dir = pathlib.Path(args["output_dir"])
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.defer_fsdp_grad_sync = True
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
        self.train_dataloader = ResumedEpochLoader(self.train_dataloader, self._consumed_batches_in_epoch(batches))
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
        self.wandb_run = None
        if self.dist_env.is_main:
            logger.info(
                "DSpark V4.1: %d optimizer steps (%d epochs x %d batches), packed_sequence_size=%d, output %s",
                self.total_optim_steps,
                self.num_epochs,
                batches,
                self.packed_sequence_size,
                self.output_dir,
            )

    def _parallelize(self, trainer_module: DSparkTrainerModule, world_size: int) -> torch.nn.Module:
        """Replicate (DDP) or shard (FSDP2, per draft layer) the trainable draft over the dp ranks."""
        if world_size == 1:
            return trainer_module
        if self.parallel_strategy == "ddp":
            return DistributedDataParallel(
                trainer_module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
                process_group=self.dp_mesh.get_group() if self.dp_mesh is not None else None,
            )
        from nemo_automodel.components.distributed.parallelizer_utils import fully_shard_by_dtype
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.dp_mesh or init_device_mesh(self.device.type, (world_size,), mesh_dim_names=("dp",))
        policy = MixedPrecisionPolicy(
            param_dtype=self.compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        fp32_names = tuple(getattr(trainer_module.draft_model, "_keep_in_fp32_modules_strict", ()))
        for layer in trainer_module.draft_model.layers:
            fully_shard_by_dtype(
                layer, mesh=mesh, mp_policy=policy, offload_policy=None, fp32_compute_module_names=fp32_names
            )
        return fully_shard(trainer_module, mesh=mesh, mp_policy=policy)

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
        from nemo_automodel.recipes._dist_utils import create_distributed_setup_from_config

        options = DeepseekV41DSparkTargetConfig(
            target_path=target_path,
            trust_remote_code=bool(args["trust_remote_code"]),
            attn_backend=str(args["target_attn_backend"]),
            dispatcher=str(args["target_dispatcher"]),
            experts=str(args["target_experts"]),
            enable_fsdp_optimizations=bool(args["target_enable_fsdp_optimizations"]),
        )
        self.distributed_setup = create_distributed_setup_from_config(self.cfg, world_size=self.dist_env.world_size)
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

    def _forward_batch(self, batch):
        """Upstream's step, plus running counts of real tokens and a data checksum (all dp ranks)."""
        ids = batch["input_ids"].to(torch.long)
        weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.long)
        checksum = int(((ids.cpu() * weights).sum(1) % 1_000_003).sum())
        stats = torch.tensor([int(batch["attention_mask"].sum()), checksum], dtype=torch.long)
        tokens, checksum = self._dp_allreduce(stats).tolist()
        self._tokens_seen += int(tokens)
        self._data_checksum = (self._data_checksum + int(checksum)) % 2**61
        return super()._forward_batch(batch)

    def _save_extra_state(self, path: str, epoch: int) -> None:
        """Upstream's DSpark meta, plus the token and data-checksum counters (``progress_meta.pt``)."""
        super()._save_extra_state(path, epoch)
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


class ResumedEpochLoader:
    """A dataloader whose first epoch starts ``skip`` micro-batches in (the resume point).

    The skipped batches are the ones the checkpointed steps already trained on, so a resumed
    run neither repeats nor drops data. Creating that first iterator leaves the global RNG as
    the checkpoint restored it: in the uninterrupted run its draw happened before the
    checkpoint, and anchor sampling must continue from the same RNG state.

    Args:
        loader: The epoch's DataLoader (deterministic order per epoch: ``sampler.set_epoch``).
        skip: Micro-batches to skip in the first epoch iterated.
    """

    def __init__(self, loader, skip: int) -> None:
        self.loader = loader
        self.skip = int(skip)

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader) - self.skip

    def __iter__(self):
        if not self.skip:
            return iter(self.loader)
        with torch.random.fork_rng(devices=[]):
            iterator = iter(self.loader)
        skip, self.skip = self.skip, 0
        return itertools.islice(iterator, skip, None)


__all__ = [
    "RECIPE_ARGS",
    "ResumedEpochLoader",
    "TrainPackedDSparkV41Recipe",
    "build_packed_draft",
    "load_local_target",
    "require_v41_checkpoint",
    "validate_recipe_config",
]
