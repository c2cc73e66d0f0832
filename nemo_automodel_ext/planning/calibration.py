"""Measured per-token and per-anchor bytes of packed DSpark at V4.1-Flash widths: what the memory model is fitted to.

The memory model's activation terms are not formulas of the config: they are least-squares fits to
bytes counted by ``allocations.LiveBytes`` while upstream's modules and the plugin's capture and draft
step run on CPU at the real V4.1-Flash widths (hidden 5120, 64 heads of 512, HC 4 streams, top-6 of
experts 2304 wide, vocab 129280), bf16, on single-document rows of a few short lengths:

- ``capture``: the plugin's capture (``DeepseekV41DSparkTargetModel.generate_batch``, no grad) through a
  5-layer target holding one layer of each V4.1 kind (sliding window; compressed ratio 2 with its KV and
  index source; ratio 1 with the candidate source; a hierarchical reindex layer; a reuse layer) with the
  feature layers 2-4: peak bytes above the weights, fitted ``a + b T + c T^2`` in the row's tokens. The 40
  Flash layers carry the same state from layer to layer (one residual stream, one compressed KV, one
  candidate set, three feature layers) as these 5, so the peak of 5 is the peak of 40.
  Layer 1 carries an Engram block, as Flash's layers 1 and 14 do (``attach_engram``): a 4,096-row table
  (activations follow the lookups, not the rows) fed by a stand-in for the n-gram hash, which needs the
  released tokenizer: seeded rows in the shape and dtype the hash returns for Flash's two Engram layers
  (int64 [batch, tokens, 2, 24], alive through the forward: 384 B a token).
- ``engram``: one Engram block alone (``measure_engram``) on ``T`` tokens, peak above its input, ``a + b T``:
  its transients stay below the capture's peak, which is why the capture's fit holds them (pinned in tests).
- ``captured``: bytes the capture hands to the draft (features and last hidden state), ``b T``.
- ``draft_step``: the draft's forward, DSpark loss and backward (activation checkpointing on, as the
  recipes set it) on one ``T``-token document with ``A`` anchors of the Flash block: peak above the
  parameters and the captured inputs, each gradient dropped once accumulated (FSDP2 frees it once
  reduce-scattered), fitted ``a + b A + c T``; and its timeline (``DRAFT_WINDOWS``), each window's peak
  fitted the same way: ``forward`` (the draft's layers, up to the last stage's outputs), ``loss`` (the head,
  the DSpark loss and their backward, up to the first gradient reaching the last stage) and ``layers
  backward`` (the rest: each layer's checkpointed recompute and backward). The memory model adds FSDP2's
  per-layer buffers and the draft's expert dispatch only to the windows where they are alive.
- ``draft_gradients``: bytes of gradients the backward leaves, per trainable draft parameter.
- ``optimizer``: AdamW state per parameter after a step on bf16 parameters, and the step's transient
  bytes per parameter.

Stand-ins (``cpu_stand_ins``): TileLang's indexer-score and sparse-attention kernels, which allocate their
outputs only (their tiles live in on-chip memory), are replaced by functions allocating exactly those
outputs; the HC Sinkhorn runs its torch path ([tokens, 4, 4] either way); the MoE activation, compiled on
GPU, runs eagerly (its fp32 gate and up copies are counted: an over-count of at most 55 KiB a token). The
target has 8 routed experts a layer instead of 384, the draft 8 instead of 128 (activations depend on the
top-6 and top-3, not on the expert count; the routers' fp32 logits add 1.5 KiB a target token and 0.5 KiB
a draft token, not counted), and its Engram table lives on one rank (the row-owner lookup's all-to-all buffers
across ranks are not measured; ``memory_model`` adds them to the block to show they fit under the peak).
``benchmarks/memory_calibration.py`` measures and writes ``calibration.json``; ``tests/planning`` re-measures
enough points to pin every fitted term (among them the cheap ``CHECK_TOKENS`` rows, stored but not fitted) and
pins each coefficient to the stored measurements.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

import torch

from nemo_automodel_ext.planning.allocations import LiveBytes

CALIBRATION_FILE = "calibration.json"
TOKENS = (1024, 2048, 4096, 8192)  # single-document rows of the capture phase
MOE_TOKENS = (1024, 2048)  # tokens of one MoE block alone (the bytes of a routed pair)
ENGRAM_TOKENS = (1024, 2048)  # tokens of one Engram block alone
ENGRAM_LAYER = 1  # the calibration target's layer with an Engram block (Flash: layers 1 and 14)
ENGRAM_ROWS = 4096  # rows of its table (Flash: 384M; activations follow the lookups, not the rows)
# (anchors, document tokens) of the draft-step phase: at 64 anchors and more the step's peak is the loss's
# backward, whose bytes grow with the anchors (below it is the frozen head's fp32 copy, a constant).
DRAFT_STEPS = ((64, 2048), (128, 2048), (256, 2048), (64, 4096), (64, 8192))
DRAFT_WINDOWS = ("forward", "loss", "layers backward")  # the draft step's timeline (see the module docstring)
# Capture rows measured and stored beside the fitted ones but never fitted (``capture check``, ``captured check``):
# the re-measurement test's cheap third point. With TOKENS' first two, 512 tokens pins the capture's three terms
# as a 4,096-token row does, at an eighth of its cost (77 s against about 600 of one core on 2026-12-07, when
# the 4,096-token row took 10 of the suite's 45 minutes on 2 cores).
CHECK_TOKENS = (512,)
# Expert counts ``calibrate`` does not record among the widths: the routed ones are stand-ins (EXPERTS), and the
# stored record has never pinned them (activations follow top-k, not the count).
STAND_IN_WIDTHS = ("draft_experts", "shared_experts")
EXPERTS = 8  # routed experts a layer (Flash: 384 in the target, 128 in the draft; only the routers' logits differ)
FLASH_OVERRIDES: dict[str, Any] = {
    "num_hidden_layers": 5,
    "compress_ratios": [0, 2, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [1, 2],
    "index_source_layer_ids": [1, 2, 3],
    "candidate_source_layer_id": 2,
    "engram_layer_ids": [],
    "engram_num_embeddings": [],
    "n_routed_experts": EXPERTS,
    "dspark_n_routed_experts": EXPERTS,
    "dspark_target_layer_ids": [2, 3, 4],
}


def calibration_config():
    """The 5-layer V4.1 config at released V4.1-Flash widths (``DeepseekV41Config``)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig

    text = DeepseekV41TextConfig().to_dict()
    text.update(FLASH_OVERRIDES)
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})


@contextlib.contextmanager
def cpu_stand_ins(math_sdpa: bool = True) -> Iterator[None]:
    """Upstream's CUDA-only kernels replaced by CPU functions allocating what the kernels allocate.

    Active only inside the ``with`` block (build and measure inside it); upstream is restored after.

    Args:
        math_sdpa: Run ``scaled_dot_product_attention`` on its math kernel, the one CUDA took for the draft's
            attention at Flash widths (head_dim 512 is beyond flash attention): an H200's allocator peak of
            the draft step equalled this counter's on that kernel at 64 and 256 anchors (docs/gpu_check.md).
            Where CUDA takes a fused kernel, the step holds less. False measures whatever the device picks.
    """
    from unittest import mock

    from nemo_automodel.components.models.deepseek_v41 import attention
    from nemo_automodel.components.moe import experts
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def indexer_scores(queries, keys, weights, allowed):  # [batch, queries, keys] fp32, like the kernel
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)

    def sparse_attention(query, kv, sinks, indices, scale, **_):  # [batch, queries, heads, head_dim]
        return torch.zeros_like(query)

    eager_swiglu = getattr(experts.swiglu_clamped_deepep, "_torchdynamo_orig_callable", experts.swiglu_clamped_deepep)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(attention, "indexer_scores", indexer_scores))
        stack.enter_context(mock.patch.object(attention, "dsv4_sparse_attention", sparse_attention))
        stack.enter_context(mock.patch.object(experts, "swiglu_clamped_deepep", eager_swiglu))
        if math_sdpa:
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        yield


def _initialise(module: torch.nn.Module, seed: int) -> None:
    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.is_floating_point():
                parameter.normal_(0.0, 0.02, generator=generator)
        for buffer in module.buffers():
            if buffer.is_floating_point():
                buffer.zero_()


def build_calibration_target(seed: int = 0, device: str | torch.device = "cpu"):
    """The calibration target in bf16 on ``device``, eval mode, with the packed indexer (in ``cpu_stand_ins``)."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer
    from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend

    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(calibration_config(), backend=cpu_backend(attn="tilelang"))
    model = model.to_empty(device=device)  # the config's dtypes: bf16, fp32 where upstream keeps it
    _initialise(model, seed)
    for module in model.modules():
        if hasattr(module, "sinkhorn_backend"):
            module.sinkhorn_backend = "torch"
    install_packed_indexer(model)
    attach_engram(model, seed)
    return model.eval()


class StandInEngramHash(torch.nn.Module):
    """Upstream's ``DeepseekV41NgramHash`` output without the released tokenizer it needs: seeded table rows,
    int64 [batch, sequence, engram_layers, hash_heads] (the shape, dtype and lifetime of the hash's result)."""

    def __init__(self, layers: int, hash_heads: int, rows: int) -> None:
        super().__init__()
        self.layers, self.hash_heads, self.rows = layers, hash_heads, rows

    def forward(self, input_ids: torch.Tensor, token_mask=None, sequence_ids=None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(input_ids.shape[1])
        rows = torch.randint(0, self.rows, (*input_ids.shape, self.layers, self.hash_heads), generator=generator)
        return rows.to(input_ids.device)


def build_engram_block(seed: int = 3, device: str | torch.device = "cpu"):
    """Upstream's ``DeepseekV41Engram`` of layer ``ENGRAM_LAYER`` at Flash widths, bf16, ``ENGRAM_ROWS`` table rows."""
    from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41Engram

    from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend

    text = calibration_config().text_config
    text = text.__class__(
        **{**text.to_dict(), "engram_layer_ids": [ENGRAM_LAYER], "engram_num_embeddings": [ENGRAM_ROWS]}
    )
    with torch.device("meta"):
        block = DeepseekV41Engram(text, ENGRAM_LAYER, cpu_backend(attn="tilelang"))
    block = block.to_empty(device=device)
    _initialise(block, seed)
    return block


def attach_engram(model, seed: int = 0) -> None:
    """Give ``model``'s layer ``ENGRAM_LAYER`` an Engram block and its text model the stand-in hash (in place)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    block = build_engram_block(seed + 3, next(model.parameters()).device)
    model.model.layers[str(ENGRAM_LAYER)].engram = block
    flash_layers = len(DeepseekV41TextConfig().engram_layer_ids)
    model.model.engram_hash = StandInEngramHash(flash_layers, block.hash_heads, ENGRAM_ROWS)


def _document(tokens: int, vocab: int, seed: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab - 16, (1, tokens), generator=generator)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
        "position_ids": torch.arange(tokens).unsqueeze(0),
        "seq_lens": torch.tensor([[tokens]]),
        "doc_remaining": torch.arange(tokens - 1, -1, -1).unsqueeze(0),
    }
    return {name: value.to(device) for name, value in batch.items()}


def run_capture(target, tokens: int, mode: contextlib.AbstractContextManager):
    """One capture of a ``tokens``-token document under ``mode`` (a ``LiveBytes`` or a FLOP counter).

    Args:
        target: ``build_calibration_target()`` (inside ``cpu_stand_ins``).
        tokens: Tokens of the document (one row).
        mode: The counting mode the capture runs in; the wrapper and the batch are made outside it.

    Returns:
        The captured ``DSparkTargetBatch`` (its features and last hidden state are new storages).
    """
    from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel

    text = target.config.text_config
    # The packed rows as given: the capture a GPU's sparse attention runs (never the CPU's length classes).
    wrapper = DeepseekV41DSparkTargetModel(target, list(text.dspark_target_layer_ids), length_classes="never")
    batch = _document(tokens, int(text.vocab_size), seed=tokens, device=next(target.parameters()).device)
    with mode:
        return wrapper.generate_batch(**batch)


def measure_capture(target, tokens: int) -> dict[str, int]:
    """Bytes of one capture of a ``tokens``-token document (``run_capture``).

    Returns:
        ``{"peak": bytes, "captured": bytes}``: the most bytes alive at once during the capture and those its
        result holds (features and last hidden state), both above the weights and the batch.
    """
    tape = LiveBytes()
    captured = run_capture(target, tokens, tape)
    peak = tape.peak
    held = tape.reset_peak()
    del captured
    return {"peak": peak, "captured": held}


def run_moe(target, tokens: int, mode: contextlib.AbstractContextManager) -> None:
    """One target MoE block (the last layer's gate, routed and shared experts) on ``tokens`` tokens under ``mode``.

    The block runs alone, without autograd, on a bf16 input made outside ``mode``, as it runs in a capture; its
    output is dropped at once.
    """
    text = target.config.text_config
    block = list(target.model.layers.values())[-1].ffn
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(1, tokens, int(text.hidden_size), generator=generator).to(torch.bfloat16)
    hidden = hidden.to(next(target.parameters()).device)
    with torch.no_grad(), mode:
        block(hidden)


def measure_moe(target, tokens: int) -> int:
    """Peak bytes of one target MoE block on ``tokens`` tokens (``run_moe``), above its input and weights.

    Its slope in tokens, divided by ``num_experts_per_tok``, is the bytes a routed pair costs the rank that
    computes it (``moe_pair`` in the record): on the busiest rank of an unbalanced expert-parallel group the
    pairs, not the tokens, set the block's peak (``Estimate.imbalance``). The CPU stand-in runs upstream's
    ``GroupedExperts`` torch path; a GPU's grouped GEMM keeps its intermediates in bf16, so this is an upper
    bound there (``benchmarks/gpu_check.py`` measures the block on CUDA).
    """
    tape = LiveBytes()
    run_moe(target, tokens, tape)
    return tape.peak


def run_engram(block, tokens: int, mode: contextlib.AbstractContextManager) -> None:
    """One Engram block (``build_engram_block``) on ``tokens`` tokens under ``mode``, without autograd, on a bf16
    residual [1, tokens, hc_mult, hidden] and table rows made outside ``mode``; its output is dropped at once."""
    generator = torch.Generator().manual_seed(tokens)
    device = next(block.parameters()).device
    hidden = torch.randn(1, tokens, block.hc_mult, block.hidden_size, generator=generator).to(torch.bfloat16)
    rows = torch.randint(0, ENGRAM_ROWS, (1, tokens, block.hash_heads), generator=generator)
    hidden, rows = hidden.to(device), rows.to(device)
    with torch.no_grad(), mode:
        block(hidden, rows)


def measure_engram(block, tokens: int) -> int:
    """Peak bytes of one Engram block on ``tokens`` tokens (``run_engram``), above its input and weights."""
    tape = LiveBytes()
    run_engram(block, tokens, tape)
    return tape.peak


def build_calibration_draft(anchors: int, seed: int = 1, device: str | torch.device = "cpu"):
    """The released Flash draft (3 layers, block 5) at the calibration widths, bf16, checkpointed, on ``device``.

    Returns:
        ``PackedDSparkTrainerModule`` around a packed draft with a frozen embedding and head (random: the
        values change no allocation) and the Flash recipes' loss weights.
    """
    from nemo_automodel.components.models.common.utils import cast_model_to_dtype
    from nemo_automodel.recipes.llm._spec_train_utils import apply_draft_activation_checkpointing

    from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
    from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
    from nemo_automodel_ext.models.deepseek_v41.tiny import released_draft_options

    text = calibration_config().text_config
    with torch.device("meta"):
        draft = DeepseekV41PackedDSparkModel.from_options(
            released_draft_options(text, num_anchors=anchors), anchors_per_document=anchors
        )
    draft = draft.to_empty(device=device)
    cast_model_to_dtype(draft, torch.bfloat16)  # as the recipe on CUDA
    _initialise(draft, seed)
    draft.set_embedding_head_trainable(False)
    apply_draft_activation_checkpointing(draft, True)
    return PackedDSparkTrainerModule(
        draft, loss_decay_gamma=None, ce_loss_alpha=0.1, l1_loss_alpha=0.9, confidence_head_alpha=1.0
    ).train()


def run_draft_step(trainer, anchors: int, tokens: int, mode: contextlib.AbstractContextManager) -> float:
    """One draft step (forward, DSpark loss, backward) with ``anchors`` anchors on a ``tokens``-token document,
    the trainer's forward and backward under ``mode`` (a ``LiveBytes`` or a FLOP counter).

    Each parameter's gradient is dropped as soon as it is accumulated, as FSDP2 frees a layer's unsharded
    gradient once reduce-scattered (the memory model adds those per-layer buffers from FSDP2's code path).

    Args:
        trainer: ``build_calibration_draft()``; its gradients are dropped before and after.
        anchors: Anchors of the document.
        tokens: Tokens of the document (the captured features' length); features are made outside ``mode``.
        mode: The counting mode.

    Returns:
        Gradient bytes the backward produced per trainable parameter.
    """
    text = trainer.draft_model.config
    device = next(trainer.parameters()).device
    batch = _document(tokens, int(text.vocab_size), seed=anchors, device=device)
    generator = torch.Generator(device=device).manual_seed(anchors)
    width = len(text.dspark_target_layer_ids) * int(text.hidden_size)
    features = torch.randn(1, tokens, width, generator=generator, device=device).to(torch.bfloat16)
    last = torch.randn(1, tokens, int(text.hidden_size), generator=generator, device=device).to(torch.bfloat16)
    trainer.zero_grad(set_to_none=True)
    trainer.draft_model.anchors_per_document = anchors
    gradient_bytes = []

    def reduce_scatter(parameter: torch.Tensor) -> None:  # FSDP2 frees a layer's unsharded gradient once reduced
        if parameter.grad is not None:
            gradient_bytes.append(parameter.grad.untyped_storage().nbytes())
            parameter.grad = None

    hooks = [p.register_post_accumulate_grad_hook(reduce_scatter) for p in trainer.parameters() if p.requires_grad]
    if isinstance(mode, LiveBytes):
        hooks.append(_mark_windows(trainer.draft_model.layers[-1], mode))
    torch.manual_seed(anchors)
    try:
        with mode:
            if isinstance(mode, LiveBytes):
                mode.mark(DRAFT_WINDOWS[0])
            metrics = trainer(
                batch["input_ids"],
                features,
                batch["loss_mask"],
                last,
                batch["position_ids"],
                batch["seq_lens"],
                batch["doc_remaining"],
            )
            metrics.loss.backward()
            if isinstance(mode, LiveBytes):
                mode.mark(None)
    finally:
        for hook in hooks:
            hook.remove()
    trainable = sum(p.numel() for p in trainer.parameters() if p.requires_grad)
    return sum(gradient_bytes) / trainable


def _mark_windows(last_stage: torch.nn.Module, tape: LiveBytes):
    """Hooks marking the draft step's windows on ``tape``: ``loss`` once the last stage's forward returns,
    ``layers backward`` when the first gradient reaches one of its outputs. Returns a handle removing them."""
    from torch.utils._pytree import tree_leaves

    reached = []

    def on_gradient(gradient: torch.Tensor) -> None:
        if not reached:
            reached.append(True)
            tape.mark(DRAFT_WINDOWS[2])

    def on_output(module, inputs, output) -> None:
        tape.mark(DRAFT_WINDOWS[1])
        for value in tree_leaves(output):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(on_gradient)

    return last_stage.register_forward_hook(on_output)


def measure_draft_step(trainer, anchors: int, tokens: int) -> dict[str, Any]:
    """Bytes of one draft step (``run_draft_step``).

    Returns:
        ``{"peak": bytes, "gradients": bytes a trainable parameter, "windows": {window: bytes}}``: the most
        bytes alive at once above the parameters and the captured inputs, the gradient bytes the backward
        produced per parameter, and the most alive in each of ``DRAFT_WINDOWS`` (their largest is the peak).
    """
    tape = LiveBytes()
    gradients = run_draft_step(trainer, anchors, tokens, tape)
    return {"peak": tape.peak, "gradients": gradients, "windows": dict(tape.windows)}


def measure_optimizer(parameters: int = 1 << 22) -> dict[str, float]:
    """AdamW (upstream's optimizer builder default, ``torch.optim.AdamW``) on ``parameters`` bf16 parameters.

    Returns:
        ``{"state": bytes a parameter after the first step, "transient": bytes a parameter alive at once
        during it beyond the state}``.
    """
    weight = torch.nn.Parameter(torch.zeros(parameters, dtype=torch.bfloat16))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.AdamW([weight], lr=1e-4)
    with LiveBytes() as tape:
        optimizer.step()
    held = [value for value in optimizer.state[weight].values() if isinstance(value, torch.Tensor)]
    state = sum(value.untyped_storage().nbytes() for value in held)
    return {"state": state / parameters, "transient": (tape.peak - state) / parameters}


def fit(points: list[list[float]], degree: int = 1) -> list[float]:
    """Least-squares coefficients through measured points, in float64.

    Args:
        points: ``[x, bytes]`` rows (one variable: ``bytes = a + b x + c x^2 ...`` up to ``degree``) or
            ``[x, y, bytes]`` rows (two variables, ``degree`` 1: ``bytes = a + b x + c y``).
        degree: Polynomial degree of the one-variable fit.

    Returns:
        ``[a, b, ...]``.
    """
    values = torch.tensor(points, dtype=torch.float64)
    variables, measured = values[:, :-1], values[:, -1:]
    if variables.shape[1] == 1:
        design = torch.cat([variables**k for k in range(degree + 1)], dim=1)
    else:
        design = torch.cat([torch.ones_like(variables[:, :1]), variables], dim=1)
    return torch.linalg.lstsq(design, measured).solution.squeeze(1).tolist()


def moe_pair(points: list[list[float]], topk: int) -> float:
    """Bytes a routed pair adds to an MoE block's peak: the slope of ``measure_moe``'s points, per routed pair."""
    (first, first_bytes), (last, last_bytes) = points[0], points[-1]
    return (last_bytes - first_bytes) / (last - first) / topk


def calibrate(log=print) -> dict[str, Any]:
    """Measure every phase and fit it (about 7 minutes on 2 cores, 12 GB of memory). Returns the calibration record."""
    points: dict[str, list[list[float]]] = {
        "capture": [],
        "captured": [],
        "moe": [],
        "engram": [],
        "draft_step": [],
        "draft_gradients": [],
    }
    points.update({f"draft {window}": [] for window in DRAFT_WINDOWS})
    points.update({"capture check": [], "captured check": []})
    with cpu_stand_ins():
        target = build_calibration_target()
        for tokens in TOKENS:
            measured = measure_capture(target, tokens)
            points["capture"].append([tokens, measured["peak"]])
            points["captured"].append([tokens, measured["captured"]])
            log(f"capture {tokens} tokens: peak {measured['peak'] / 2**20:.1f} MiB")
        for tokens in CHECK_TOKENS:
            measured = measure_capture(target, tokens)
            points["capture check"].append([tokens, measured["peak"]])
            points["captured check"].append([tokens, measured["captured"]])
        for tokens in MOE_TOKENS:
            points["moe"].append([tokens, measure_moe(target, tokens)])
        del target
        block = build_engram_block()
        for tokens in ENGRAM_TOKENS:
            points["engram"].append([tokens, measure_engram(block, tokens)])
        del block
        trainer = build_calibration_draft(DRAFT_STEPS[0][0])
        for anchors, tokens in DRAFT_STEPS:
            measured = measure_draft_step(trainer, anchors, tokens)
            points["draft_step"].append([anchors, tokens, measured["peak"]])
            points["draft_gradients"].append([anchors, tokens, measured["gradients"]])
            for window in DRAFT_WINDOWS:
                points[f"draft {window}"].append([anchors, tokens, measured["windows"][window]])
            log(f"draft step {anchors} anchors, {tokens} tokens: peak {measured['peak'] / 2**20:.1f} MiB")
    optimizer = measure_optimizer()
    from nemo_automodel_ext.planning.counts import model_counts

    return {
        "torch": torch.__version__.split("+")[0],
        "config": {
            "widths": "DeepseekV41TextConfig() (V4.1-Flash)",
            **FLASH_OVERRIDES,
            "engram_block": {"layer": ENGRAM_LAYER, "rows": ENGRAM_ROWS, "hash": "stand-in, Flash's shape"},
        },
        # The widths activations scale with; the expert counts are stand-ins (EXPERTS), which the model may differ in.
        "widths": {
            key: value
            for key, value in model_counts(calibration_config().text_config).widths.items()
            if key not in STAND_IN_WIDTHS
        },
        "points": points,
        "coefficients": {
            "capture": fit(points["capture"], 2),
            "captured": fit(points["captured"], 1),
            "moe_pair": [moe_pair(points["moe"], int(calibration_config().text_config.num_experts_per_tok))],
            "engram": fit(points["engram"], 1),
            "draft_step": fit(points["draft_step"]),
            "draft_gradients": [max(p[-1] for p in points["draft_gradients"])],
            **{f"draft {window}": fit(points[f"draft {window}"]) for window in DRAFT_WINDOWS},
            "optimizer_state": [optimizer["state"]],
            "optimizer_transient": [optimizer["transient"]],
        },
    }


def load_calibration() -> dict[str, Any]:
    """The shipped calibration record (``planning/calibration.json``, from ``benchmarks/memory_calibration.py``)."""
    return json.loads(resources.files(__package__).joinpath(CALIBRATION_FILE).read_text())


__all__ = [
    "CHECK_TOKENS",
    "DRAFT_STEPS",
    "DRAFT_WINDOWS",
    "ENGRAM_LAYER",
    "ENGRAM_TOKENS",
    "TOKENS",
    "attach_engram",
    "build_engram_block",
    "build_calibration_draft",
    "build_calibration_target",
    "calibrate",
    "calibration_config",
    "cpu_stand_ins",
    "fit",
    "load_calibration",
    "measure_capture",
    "measure_engram",
    "measure_draft_step",
    "measure_optimizer",
    "run_capture",
    "run_engram",
    "run_draft_step",
]
