"""Step time (``planning/step_time.py``): FLOPs pinned to ``torch.utils.flop_counter`` at Flash widths; the search."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from nemo_automodel_ext.planning.calibration import (
    ENGRAM_LAYER,
    build_calibration_draft,
    build_calibration_target,
    calibration_config,
    cpu_stand_ins,
    run_capture,
    run_draft_step,
)
from nemo_automodel_ext.planning.memory_model import Layout, model_counts
from nemo_automodel_ext.planning.step_time import DRAFT_MFU, GPUS, MFU, fastest_fitting, micro_batch_flops, step_time

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def calibration():
    text = calibration_config().text_config
    return text, model_counts(text)


def test_target_and_draft_flops_match_the_flop_counter(calibration, flash_widths_alone):
    """The calibration target (5 Flash-width layers, 8.2 GiB of weights) and the released draft's step at 16 and
    32 anchors (the anchor slope), counted by FlopCounterMode (95 s; 161 s at 64 and 128 anchors). The counter
    does not see grouped expert matmuls or the stand-in attention kernels, so the target is compared without its
    routed experts and attention; the draft's step whole, less attention."""
    text, counts = calibration
    tokens = 256
    layout = Layout(gpus=1, gpu_gib=141, ep=1, cp=1, rows=1, row_tokens=tokens, anchors_per_row=64)
    with cpu_stand_ins():
        target = build_calibration_target()
        counter = FlopCounterMode(display=False)
        run_capture(target, tokens, counter)
        layers = counter.get_flop_counts()["DeepseekV41ForCausalLM.model"]
        # The calibration target's Engram block (calibration.attach_engram), which its config does not declare.
        engram = 2 * tokens * target.model.layers[str(ENGRAM_LAYER)].engram.wkv.weight.numel()
        del target
        gc.collect()
        routed = 2 * counts.experts * text.num_experts_per_tok // text.n_routed_experts * tokens
        assert micro_batch_flops(counts, layout, text)["target matrices"] - routed + engram == pytest.approx(
            sum(layers.values()), rel=0.01
        )
        trainer = build_calibration_draft(64)
        for anchors, columns in ((16, 512), (32, 512)):
            counter = FlopCounterMode(display=False)
            run_draft_step(trainer, anchors, columns, counter)
            measured = sum(counter.get_flop_counts()["Global"].values())
            step = Layout(gpus=1, gpu_gib=141, ep=1, cp=1, rows=1, row_tokens=columns, anchors_per_row=anchors)
            flops = micro_batch_flops(counts, step, text)
            drafted = [name for name in flops if name.startswith("draft") and "attention" not in name]
            modelled = sum(flops[name] for name in drafted)
            # Norms, HC mixes, the Markov and confidence heads and the loss are not modelled: at most 10%.
            assert 0.90 * measured <= modelled <= measured


@pytest.mark.parametrize(("name", "preset", "gpus"), [("h200_4node", "H200", 32), ("h100_8node_cp", "H100", 64)])
def test_the_shipped_recipes_are_the_fastest_layouts_that_fit_their_gpus(name, preset, gpus):
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    from nemo_automodel_ext.planning.layouts import layout_from_config
    from nemo_automodel_ext.run.config import validate_recipe_config

    text = DeepseekV41TextConfig()
    counts = model_counts(text)
    gpu = GPUS[preset]
    cfg = load_yaml_config(str(REPO / "recipes" / "deepseek_v41" / f"dspark_flash_{name}.yaml"))
    args = validate_recipe_config(cfg, gpus, "cuda", require_packages=False)
    shipped = layout_from_config(cfg, args, gpus, gpu.memory_gib)
    best = fastest_fitting(counts, Layout(gpus, gpu.memory_gib, gpus, 1, 1, 65536, 2048), gpu, text)
    assert (best.memory.layout.ep, best.memory.layout.cp, best.memory.layout.draft_ep) == (
        shipped.ep,
        shipped.cp,
        shipped.draft_ep,
    )
    timed = step_time(counts, shipped, gpu, text)
    assert timed.tokens_per_s() == pytest.approx(best.tokens_per_s())
    # Tokens a second a GPU: the row's tokens over its CP group, over compute plus every transfer (no overlap);
    # full overlap and the network alone are faster bounds.
    assert timed.tokens_per_s() == pytest.approx(65536 / shipped.cp / (timed.compute_s + timed.communication_s))
    assert timed.tokens_per_s(timed.overlapped_s) == pytest.approx(
        65536 / shipped.cp / max(timed.compute_s, timed.communication_s)
    )
    assert timed.network_s <= timed.communication_s and timed.tokens_per_s(timed.network_s) > timed.tokens_per_s()
    # The target's FLOPs at the assumed MFU, the draft's at the measured one.
    target = sum(v for k, v in timed.flops.items() if k.startswith("target")) / (gpu.bf16_tflops * 1e12 * MFU)
    draft = sum(v for k, v in timed.flops.items() if k.startswith("draft")) / (gpu.bf16_tflops * 1e12 * DRAFT_MFU)
    assert timed.compute_s == pytest.approx(target + draft) and timed.target_compute_s == pytest.approx(target)
    gather, compute = timed.gather_budget
    assert gather == pytest.approx(timed.seconds["target FSDP all-gather"] / 40) and compute == pytest.approx(
        target / 40
    )
