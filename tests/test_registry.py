"""After `pip install`, AutoModel's registry and the plugin's DSpark registries resolve the plugin classes."""

from __future__ import annotations

import importlib.metadata

from nemo_automodel._transformers.registry import _ModelRegistry
from nemo_automodel.components.speculative.dspark.draft_qwen3 import Qwen3DSparkModel
from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel
from nemo_automodel_ext.registry import (
    DRAFT_GROUP,
    TARGET_GROUP,
    resolve_dspark_draft,
    resolve_dspark_target_wrapper,
)


def test_entry_points_are_installed():
    names = {
        group: {point.name for point in importlib.metadata.entry_points(group=group)}
        for group in ("nemo_automodel.architectures", TARGET_GROUP, DRAFT_GROUP)
    }
    assert "DeepseekV41PackedDSparkModel" in names["nemo_automodel.architectures"]
    assert "DeepseekV41ForCausalLM" in names[TARGET_GROUP]
    assert "DeepseekV41ForCausalLM" in names[DRAFT_GROUP]


def test_automodel_registry_resolves_the_plugin_architecture():
    registry = _ModelRegistry()  # a fresh registry runs entry-point discovery
    assert registry.has_custom_model("DeepseekV41PackedDSparkModel")
    assert registry.get_model_cls_from_model_arch("DeepseekV41PackedDSparkModel") is DeepseekV41PackedDSparkModel
    # Upstream's own V4.1 target stays upstream's.
    assert registry.get_model_cls_from_model_arch("DeepseekV41ForCausalLM").__module__.startswith("nemo_automodel.")


def test_dspark_registries_prefer_the_plugin_for_v41_only():
    assert resolve_dspark_target_wrapper(["DeepseekV41ForCausalLM"]) is DeepseekV41DSparkTargetModel
    assert resolve_dspark_draft(["DeepseekV41ForCausalLM"]) is DeepseekV41PackedDSparkModel
    assert resolve_dspark_target_wrapper(["Qwen3ForCausalLM"]) is HFDSparkTargetModel
    assert resolve_dspark_draft(["Qwen3ForCausalLM"]) is Qwen3DSparkModel
