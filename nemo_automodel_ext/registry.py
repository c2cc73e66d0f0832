"""DSpark target/draft registries of the plugin, filled from package entry points.

AutoModel 0.7.0 discovers model architectures through the ``nemo_automodel.architectures``
entry-point group, but its DSpark draft registry is a module-level dict and its target
wrapper is a single class. The plugin therefore declares two entry-point groups of its own,
keyed by the target's HF architecture, and resolves through them first, falling back to
upstream's registry (drafts) and ``HFDSparkTargetModel`` (targets):

- ``nemo_automodel_ext.dspark_targets``: target architecture -> target wrapper class;
- ``nemo_automodel_ext.dspark_drafts``: target architecture -> DSpark draft class.

``pip install nemo-automodel-ext`` is all it takes; nothing is patched at import time.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable

from torch import nn

TARGET_GROUP = "nemo_automodel_ext.dspark_targets"
DRAFT_GROUP = "nemo_automodel_ext.dspark_drafts"


def _entry_point_class(group: str, architectures: Iterable[str]) -> type | None:
    points = {point.name: point for point in importlib.metadata.entry_points(group=group)}
    for architecture in architectures:
        if architecture in points:
            return points[architecture].load()
    return None


def resolve_dspark_target_wrapper(architectures: Iterable[str]) -> type:
    """The DSpark target wrapper class for a target's HF ``architectures`` list.

    Returns:
        The plugin's registered wrapper (``DeepseekV41DSparkTargetModel`` for
        ``DeepseekV41ForCausalLM``), else upstream's ``HFDSparkTargetModel``.
    """
    found = _entry_point_class(TARGET_GROUP, list(architectures))
    if found is not None:
        return found
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    return HFDSparkTargetModel


def resolve_dspark_draft(architectures: Iterable[str]) -> type[nn.Module]:
    """The DSpark draft class for a target's HF ``architectures`` list.

    Returns:
        The plugin's registered draft (``DeepseekV41PackedDSparkModel`` for
        ``DeepseekV41ForCausalLM``), else upstream's ``resolve_dspark_draft_spec`` result.

    Raises:
        ValueError: from upstream when no registry knows the architecture.
    """
    architectures = list(architectures)
    found = _entry_point_class(DRAFT_GROUP, architectures)
    if found is not None:
        return found
    from nemo_automodel.components.speculative.dspark.registry import resolve_dspark_draft_spec

    return resolve_dspark_draft_spec(architectures).draft_cls


__all__ = ["DRAFT_GROUP", "TARGET_GROUP", "resolve_dspark_draft", "resolve_dspark_target_wrapper"]
