"""The memory and communication model (``planning/memory_model.py``) and the GPU recipes it lays out."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from nemo_automodel.components.config.loader import load_yaml_config
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig
from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41Engram
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend, tiny_target_config
from nemo_automodel_ext.planning.layouts import check_layout_fits, layout_from_config
from nemo_automodel_ext.planning.memory_model import (
    GIB,
    Calibration,
    Layout,
    draft_ep_passes,
    engram_block_parameters,
    engram_table_parameters,
    estimate,
    model_counts,
    rank_anchors,
    routed_expert_parameters,
)
from nemo_automodel_ext.recipes.builders import check_layout_memory
from nemo_automodel_ext.run.config import validate_recipe_config

REPO = Path(__file__).resolve().parents[2]
# The GPUs each shipped GPU recipe is laid out for: (ranks, GiB a GPU).
GPU_RECIPES = {"dspark_flash_h200_4node.yaml": (32, 141), "dspark_flash_h100_8node_cp.yaml": (64, 80)}


@pytest.fixture(scope="module")
def flash():
    text = DeepseekV41TextConfig()  # upstream's defaults are the released V4.1-Flash
    return text, model_counts(text)


def test_routed_experts_match_the_meta_device_count(flash):
    text, counts = flash
    values = text.to_dict()
    values.update(engram_layer_ids=[], engram_num_embeddings=[])
    with torch.device("meta"):
        target = DeepseekV41ForCausalLM(
            DeepseekV41Config(text_config=values, vision_config={"num_hidden_layers": 0}), backend=cpu_backend()
        )
    on_meta = sum(p.numel() for name, p in target.named_parameters() if ".experts." in name)
    assert on_meta == counts.experts == counts.moe_layers * routed_expert_parameters(text)
    assert round(on_meta / 1e9, 1) == 543.6  # the review's count; 1012.5 GiB in bf16
    assert on_meta * 2 / GIB == pytest.approx(1012.5, abs=0.05)
    # Built without its Engram layers: their blocks' projections and norms are counted by formula (next test).
    assert counts.dense == sum(p.numel() for p in target.parameters()) - on_meta + engram_block_parameters(text)


def test_engram_tables_match_the_meta_device_modules(flash):
    text, counts = flash
    with torch.device("meta"):
        blocks = [DeepseekV41Engram(text, layer, cpu_backend()) for layer in text.engram_layer_ids]
    tables = [block.embed.weight.numel() for block in blocks]
    assert sum(tables) == engram_table_parameters(text) == counts.engram
    rest = sum(p.numel() for block in blocks for name, p in block.named_parameters() if not name.startswith("embed."))
    assert rest == engram_block_parameters(text) and round(rest / 1e9, 2) == 0.31
    assert [round(t * 2 / GIB) for t in tables] == [183, 183]


def test_tiny_counts_match_its_meta_model():
    text = tiny_target_config().text_config
    counts = model_counts(text, 8)
    with torch.device("meta"):
        target = DeepseekV41ForCausalLM(tiny_target_config(), backend=cpu_backend())
    assert counts.target == sum(p.numel() for p in target.parameters())


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipes_fit_with_the_headroom_they_state(flash, name):
    _, counts = flash
    path = REPO / "recipes" / "deepseek_v41" / name
    cfg = load_yaml_config(path)
    gpus, gib = GPU_RECIPES[name]
    args = validate_recipe_config(cfg, gpus, "cuda", require_packages=False)
    result = check_layout_fits(counts, layout_from_config(cfg, args, gpus, gib))
    assert result.fits and result.headroom >= 0.10 * result.usable
    stated = re.search(r"([\d.]+) GiB a GPU of ([\d.]+) usable \(([\d.]+) GiB headroom\)", path.read_text())
    assert stated, f"{name} must state the model's estimate in its header"
    assert [float(v) for v in stated.groups()] == [
        round(result.total / GIB, 1),
        round(result.usable / GIB, 1),
        round(result.headroom / GIB, 1),
    ]


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_routing_imbalance_is_charged_by_the_pairs_of_the_busiest_rank(flash, name):
    """+100% load on a group's busiest rank: the capture's MoE block holds twice its pairs at the measured bytes a
    pair, and so do a draft layer's dispatch buffers and MoE block; the tolerance is the phase that runs out
    first. Both shipped recipes tolerate at least +100%."""
    text, counts = flash
    cfg = load_yaml_config(REPO / "recipes" / "deepseek_v41" / name)
    gpus, gib = GPU_RECIPES[name]
    layout = layout_from_config(cfg, validate_recipe_config(cfg, gpus, "cuda", require_packages=False), gpus, gib)
    result = estimate(counts, layout)
    pair = Calibration.shipped().moe_pair
    local_tokens = layout.rows * layout.row_tokens / layout.cp
    assert result.imbalance["capture"] == pytest.approx(pair * local_tokens * text.num_experts_per_tok)
    draft_tokens = layout.rows * rank_anchors(layout) * text.dspark_block_size
    for phase in ("draft forward", "draft layers backward"):
        assert result.imbalance[phase] == pytest.approx(
            result.phases[phase]["draft EP dispatch buffers"] + pair * draft_tokens * text.dspark_num_experts_per_tok
        )
    tolerance = result.imbalance_tolerance()
    assert tolerance == pytest.approx(
        min((result.usable - result.phase_total(p)) / extra for p, extra in result.imbalance.items())
    )
    assert tolerance >= 1.0
    # Without expert parallelism every rank computes its own tokens' pairs: nothing to be unbalanced.
    alone = estimate(counts, replace(layout, ep=1, draft_ep=1))
    assert alone.imbalance_tolerance() == float("inf")


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_an_engram_block_stays_under_the_capture_s_peak_or_adds_what_it_exceeds(flash, name):
    """Flash's Engram block at the recipe's local tokens: its measured transients, its bf16 residual input and
    the row-owner lookup's exchange (ids and rows padded out and back, the compact and reordered rows) stay under
    the capture's measured activations, so the capture phase holds nothing more; a block that exceeded them would
    add the difference."""
    text, counts = flash
    cfg = load_yaml_config(REPO / "recipes" / "deepseek_v41" / name)
    gpus, gib = GPU_RECIPES[name]
    layout = layout_from_config(cfg, validate_recipe_config(cfg, gpus, "cuda", require_packages=False), gpus, gib)
    calibration = Calibration.shipped()
    result = estimate(counts, layout, calibration)
    tokens = layout.rows * layout.row_tokens / layout.cp
    lookups = tokens * (text.engram_max_ngram_size - 1) * text.engram_n_heads
    a, b = calibration.engram
    block = a + b * tokens + 2 * text.hc_mult * text.hidden_size * tokens + lookups * (16 + 8 * text.engram_head_dim)
    assert result.engram_block == pytest.approx(block)
    activations = result.phases["capture"]["capture activations (measured)"]
    assert 0.5 * activations < result.engram_block < activations
    assert result.phases["capture"]["Engram block beyond the capture's peak (measured)"] == 0
    heavy = estimate(counts, layout, replace(calibration, engram=(a, 4 * b)))
    assert heavy.phases["capture"]["Engram block beyond the capture's peak (measured)"] == pytest.approx(
        heavy.engram_block - activations
    )
    without = replace(counts, engram_lookups=0)
    assert estimate(without, layout, calibration).engram_block == 0


def test_eight_h100_nodes_need_the_draft_s_experts_on_ep(flash):
    """With its experts in its FSDP2 units the draft's backward buffers are whole layers (128 experts each,
    46.9 GiB): 8 H100 nodes are refused at any CP, and the nearest fit named is the same GPUs with the draft's
    experts on 8 ranks (the shipped recipe), which gathers 16 experts a layer and sends a sixth of the bytes."""
    _, counts = flash
    layout = Layout(gpus=64, gpu_gib=80, ep=64, cp=4, rows=1, row_tokens=65536, anchors_per_row=2048)
    result = estimate(counts, layout)
    fsdp = sum(value for name, value in result.phases["draft layers backward"].items() if "FSDP2" in name)
    assert fsdp / GIB == pytest.approx(46.9, abs=0.05) and result.peak_phase == "draft layers backward"
    with pytest.raises(ValueError) as error:
        check_layout_fits(counts, layout)
    message = str(error.value)
    assert "at its draft layers backward (draft layer gradients + fp32 reduce-scatter input (FSDP2) 26.7" in message
    # EP sizes the candidates offer divide the 384 target experts and the 128 draft experts.
    assert "the nearest layout that fits is 64 GPUs of 80 GiB, ep_size=64, cp_size=4, draft_ep_size=8" in message

    spread = estimate(counts, replace(layout, draft_ep=8, draft_ep_dispatch="all_gather"))
    layer = counts.draft_layer - counts.draft_layer_experts * 7 / 8
    assert spread.phases["draft layers backward"]["draft gathered layers (FSDP2)"] == 2 * 2 * layer
    tokens = 2048 // 4 * 5  # a rank's anchors x block
    # Upstream's all-gather, per layer and pass: 7 peers' tokens in bf16, the fp32 output all-reduced (2x).
    assert spread.traffic["draft EP dispatch"] == 3 * 3 * 7 * tokens * 5120 * (2 + 8)
    before = result.traffic["draft FSDP (gather x2, reduce-scatter fp32)"]
    after = sum(spread.traffic[name] for name in spread.traffic if name.startswith("draft") and "features" not in name)
    assert after < before / 4, (after / GIB, before / GIB)
    # All-to-all: each of the 3 routed pairs a token out and back in bf16, 7/8 of them to other ranks.
    pairs = estimate(counts, replace(layout, draft_ep=8))
    assert pairs.traffic["draft EP dispatch"] == pytest.approx(3 * 3 * tokens * 5120 * 2 * 2 * 3 * 7 / 8)
    assert pairs.traffic["draft EP dispatch"] < spread.traffic["draft EP dispatch"] / 6
    # Under draft EP the MoE blocks are checkpointed like every other block (recipes/parallel.parallelize_draft:
    # expert parallelism, then checkpointing): no layer keeps their activations.
    assert not any("kept" in name for phase in pairs.phases.values() for name in phase)


@pytest.mark.parametrize("name", sorted(GPU_RECIPES))
def test_gpu_recipes_keep_the_draft_under_10_gib_of_traffic_and_never_gather_its_experts(flash, name):
    """The draft's experts on every rank (draft EP = GPUs: no FSDP2 gather of experts) reached all-to-all: the
    draft sends at most 10 GiB a GPU per 32k local tokens (issue 16's goal, set at CP 2's 32k tokens a GPU a
    micro-batch; the H200 recipe's CP 1 micro-batch holds 64k and sends about 12 GiB)."""
    _, counts = flash
    cfg = load_yaml_config(REPO / "recipes" / "deepseek_v41" / name)
    gpus, gib = GPU_RECIPES[name]
    layout = layout_from_config(cfg, validate_recipe_config(cfg, gpus, "cuda", require_packages=False), gpus, gib)
    assert layout.draft_ep == gpus and layout.draft_ep_dispatch == "all_to_all"
    result = estimate(counts, layout)
    draft = {name: sent for name, sent in result.traffic.items() if name.startswith("draft")}
    local = layout.rows * layout.row_tokens / layout.cp
    assert sum(draft.values()) * 32768 / local <= 10 * GIB, {name: sent / GIB for name, sent in draft.items()}
    # FSDP2 traffic: only the non-expert parameters (experts never gather when every rank holds its own).
    peers = (gpus - 1) / gpus
    assert draft["draft FSDP (gather x2, reduce-scatter fp32)"] == pytest.approx(
        (2 * 2 + 4) * (counts.draft_trainable - counts.draft_experts) * peers
    )
    # The frozen embedding and head gather once a micro-batch in the root unit, and never reduce.
    assert draft["draft frozen root gather (FSDP2)"] == pytest.approx(2 * counts.draft_frozen * peers)
    assert 2.3 * GIB < draft["draft frozen root gather (FSDP2)"] < 2.5 * GIB


def test_expert_shards_gather_only_over_the_ranks_sharing_their_experts(flash):
    _, counts = flash
    full = estimate(counts, Layout(256, 80, 256, 16, 1, 65536, 2048)).traffic["target FSDP all-gather"]
    half = estimate(counts, Layout(256, 80, 128, 16, 1, 65536, 2048)).traffic["target FSDP all-gather"]
    assert full == pytest.approx(2 * counts.dense / 256 * 255)
    # EP 128 on 256 ranks: each rank's expert shard (experts / 256) goes to the one peer holding the same experts.
    assert half - full == pytest.approx(2 * counts.experts / 256)


def test_one_node_is_refused_with_the_estimate_and_the_nearest_layout(flash, tmp_path):
    text, counts = flash
    layout = Layout(gpus=8, gpu_gib=141, ep=8, cp=1, rows=1, row_tokens=16384, anchors_per_row=2048)
    with pytest.raises(ValueError) as error:
        check_layout_fits(counts, layout)
    message = str(error.value)
    assert "needs about 259.6 GiB a GPU at its draft layers backward" in message
    assert "target shards (bf16) 174.3" in message
    assert "the nearest layout that fits is 16 GPUs of 141 GiB, ep_size=16, cp_size=4, draft_ep_size=8" in message
    # The recipe's check reads only the target's config.json.
    DeepseekV41Config(text_config=text.to_dict(), vision_config={"num_hidden_layers": 0}).save_pretrained(tmp_path)
    cfg = load_yaml_config(REPO / "recipes/deepseek_v41/dspark_flash_h200_4node.yaml")
    cfg.recipe_args.draft_ep_size = 8  # the recipe's draft EP is its 32 GPUs; one node has 8
    args = validate_recipe_config(cfg, 8, "cuda", require_packages=False)
    with pytest.raises(ValueError, match="GiB a GPU"):
        check_layout_memory(cfg, args, str(tmp_path), 8, 141)


def test_cp_native_features_and_draft_anchors_shrink_with_cp(flash):
    _, counts = flash
    parts = []
    for native in (False, True):
        for cp in (1, 2, 4, 8):
            layout = Layout(64, 80, 64, cp, 1, 131072, 2048, cp_native=native)
            parts.append(estimate(counts, layout).phases["draft loss"])
    gathered, halo = parts[:4], parts[4:]
    features, draft = "captured features (measured)", "draft activations, logits and loss gradients (measured)"
    assert [p[features] for p in gathered] == [gathered[0][features]] * 4
    assert halo[3][features] < gathered[3][features] / 7
    # Each CP rank trains a 1/cp share of the row's anchors on its shard's columns.
    assert halo[3][draft] < gathered[3][draft] / 4


def test_indexer_term_counts_the_bands_the_packed_indexer_scores():
    """The model's band (a tile plus one document) bounds what ``indexer_bands`` gives a real row."""
    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import indexer_bands
    from nemo_automodel_ext.planning.memory_model import indexer_bytes

    row, documents = 16384, 64
    ids = torch.arange(1, documents + 1).repeat_interleave(row // documents).unsqueeze(0)
    bands = indexer_bands(torch.arange(row).unsqueeze(0), ids, ids, compression_ratio=1)
    widest = max(high - low for _, _, low, high in bands.tiles)
    assert widest <= bands.tile + row // documents
    # 5 bytes a scored pair for one tile, 1 a kept candidate, int64 ranking keys for one tile.
    band = bands.tile + row // documents
    assert indexer_bytes(1, row, 1, 1, row // documents) == 5 * bands.tile * band + row * band + 8 * bands.tile * band
    # Upstream's whole row: 6 bytes for every query-key pair (64k rows, CP 2: 12 GiB).
    assert indexer_bytes(1, 65536, 2, 1, banded=False) == 12 * GIB
    one_document, short_documents = indexer_bytes(1, 65536, 2, 1), indexer_bytes(1, 65536, 2, 1, 256)
    assert short_documents < one_document < indexer_bytes(1, 65536, 2, 1, banded=False) / 4


def test_deferred_sync_holds_every_trainable_parameter_s_fp32_gradient(flash):
    """FSDP2 with a deferred sync keeps unsharded fp32 gradients of the whole draft between micro-batches
    (4 bytes a trainable parameter); the plugin's default reduce-scatters each micro-batch and holds none."""
    _, counts = flash
    layout = Layout(gpus=32, gpu_gib=141, ep=32, cp=2, rows=1, row_tokens=65536, anchors_per_row=2048)
    key = "deferred draft gradients (unsharded fp32)"
    assert estimate(counts, replace(layout, grad_accumulation=2)).memory[key] == 0
    deferred = estimate(counts, replace(layout, grad_accumulation=2, defer_grad_sync=True))
    assert deferred.memory[key] == 4 * counts.draft_trainable
    assert estimate(counts, replace(layout, grad_accumulation=1, defer_grad_sync=True)).memory[key] == 0
    # The deferred recipe would not fit an H200: the reason the plugin does not defer.
    assert not deferred.fits


def test_the_draft_s_all_to_all_runs_again_in_its_checkpointed_recompute(flash, tmp_path, caplog):
    """The recipes checkpoint the draft, its MoE included (EP first): three all-to-all passes a layer, read from
    ``distributed.activation_checkpointing``. The calibration measured the draft step checkpointed, so a layout
    without it is refused by the model and skipped, with a warning, by the recipe's check."""
    text, counts = flash
    cfg = load_yaml_config(REPO / "recipes/deepseek_v41/dspark_flash_h200_4node.yaml")
    gpus, gib = GPU_RECIPES["dspark_flash_h200_4node.yaml"]
    args = validate_recipe_config(cfg, gpus, "cuda", require_packages=False)
    layout = layout_from_config(cfg, args, gpus, gib)
    assert layout.draft_recompute and draft_ep_passes(layout) == 3
    w = counts.widths
    pair = 2 * 2 * w["draft_topk"] * (gpus - 1) / gpus  # bf16 there and back, the share leaving the rank
    tokens = layout.rows * layout.anchors_per_row * w["block"]
    assert estimate(counts, layout).traffic["draft EP dispatch"] == pytest.approx(
        3 * w["draft_layers"] * tokens * w["hidden"] * pair
    )
    for value in ("off", "selective"):  # upstream's spellings: only full checkpointing was measured
        cfg.distributed.activation_checkpointing = value
        assert not layout_from_config(cfg, args, gpus, gib).draft_recompute
    cfg.distributed.activation_checkpointing = False
    off = layout_from_config(cfg, args, gpus, gib)
    assert not off.draft_recompute and draft_ep_passes(off) == 2
    with pytest.raises(ValueError, match="activation_checkpointing: true"):
        estimate(counts, off)
    DeepseekV41Config(text_config=text.to_dict(), vision_config={"num_hidden_layers": 0}).save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        check_layout_memory(cfg, args, str(tmp_path), gpus, gib)
    assert "activation_checkpointing off or selective" in caplog.text
