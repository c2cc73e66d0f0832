"""benchmarks/batching_at_scale.py: the GPU-scale cost model of each batching lays out what the recipe would."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from nemo_automodel.components.datasets.llm.eagle3 import build_packed_eagle3_dataset
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

from nemo_automodel_ext.planning.memory_model import Layout, estimate, model_counts
from nemo_automodel_ext.planning.step_time import FIT_MARGIN, GPUS, mean_prefix, micro_batch_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import batching_at_scale as scale  # noqa: E402

ROW = 4096
LAYOUT = Layout(gpus=16, gpu_gib=141, ep=8, cp=1, rows=1, row_tokens=ROW, anchors_per_row=128, draft_ep=16)


def test_pack_rows_packs_as_upstream():
    """Upstream's builder on real token lists and ``pack_rows`` on their lengths give the same rows."""
    rng = random.Random(3)
    lengths = [rng.choice([rng.randint(1, 300), rng.randint(300, ROW + 500)]) for _ in range(200)]
    source = [{"input_ids": [1] * n, "loss_mask": [1] * n} for n in lengths]
    upstream = [
        pack["seq_lens"] for pack in build_packed_eagle3_dataset(source, packed_sequence_size=ROW, pad_token_id=0)
    ]
    ours = [scale.folded(documents, ROW) for documents in scale.pack_rows(lengths, ROW)]
    assert ours == upstream


def test_the_indexer_counts_each_document_alone():
    """``mean_prefix`` against a token-by-token count; one document a row is the default; bad lengths refused."""
    layout = replace(LAYOUT, rows=2)
    documents = [100, 3000, 996, 4096]
    naive = sum(p + 0.5 for d in documents for p in range(d)) / (2 * ROW)  # d^2 / 2 a document, as the model counts
    assert mean_prefix(layout, documents) == pytest.approx(naive)
    assert mean_prefix(layout, [ROW, ROW]) == mean_prefix(layout) == ROW / 2
    text = DeepseekV41TextConfig()
    counts = model_counts(text)
    whole = micro_batch_flops(counts, layout, text)["target indexer"]
    assert micro_batch_flops(counts, layout, text, documents)["target indexer"] < whole
    with pytest.raises(ValueError, match="documents must be positive lengths summing to rows x row_tokens = 8192"):
        mean_prefix(layout, [100, 200])


def test_every_document_once_and_the_unpacked_lose_what_one_gpu_cannot_hold():
    """Real plus lost tokens are the mix's for every batching; only the unpacked lose documents over the limit;
    upstream's rows are the budget over the mix's longest; the token-budget batches stay within the budget."""
    rng = random.Random(0)
    lengths = [rng.randint(16, 600) for _ in range(400)] + [3000, 3500]
    limit = 2048
    for batching in scale.BATCHINGS:
        batches, lost = scale.micro_batches(batching, lengths, LAYOUT, limit)
        assert sum(batch.real for batch in batches) + lost == sum(lengths), batching
        if batching == "packed":
            assert lost == 0 and all(batch.width == ROW for batch in batches)
        elif batching == "upstream":
            assert lost == 3000 + 3500 - 2 * limit
            assert {batch.rows for batch in batches[:-1]} == {ROW // limit}
        else:
            assert lost == 3000 + 3500
            assert all(batch.rows * batch.width <= ROW for batch in batches)


def test_longest_single_is_the_widest_row_that_fits():
    """The limit fits with the margin and one more step does not (the H100 recipe's layout at 64k rows)."""
    text = DeepseekV41TextConfig()
    counts = model_counts(text)
    gpu = GPUS["H100"]
    layout = Layout(gpus=64, gpu_gib=80, ep=8, cp=2, rows=1, row_tokens=65536, anchors_per_row=2048, draft_ep=64)
    limit = scale.longest_single(counts, layout, gpu)
    assert 0 < limit < layout.row_tokens

    def spare(width):
        fitted = estimate(counts, scale.unpacked_layout(layout, 1, width, gpu))
        return fitted.headroom - FIT_MARGIN * fitted.usable

    assert spare(limit) >= 0 > spare(limit + scale.WIDTH_STEP)
