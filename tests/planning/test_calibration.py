"""The memory model's measured coefficients: the tape that counts them, the fit, and a re-measurement."""

from __future__ import annotations

import gc

import pytest
import torch

from nemo_automodel_ext.planning.allocations import LiveBytes, peak_bytes
from nemo_automodel_ext.planning.calibration import (
    CHECK_TOKENS,
    DRAFT_STEPS,
    DRAFT_WINDOWS,
    ENGRAM_LAYER,
    ENGRAM_TOKENS,
    MOE_TOKENS,
    TOKENS,
    build_calibration_draft,
    build_calibration_target,
    build_engram_block,
    cpu_stand_ins,
    fit,
    load_calibration,
    measure_capture,
    measure_draft_step,
    measure_engram,
    measure_moe,
    measure_optimizer,
    moe_pair,
)
from nemo_automodel_ext.planning.memory_model import Calibration, Layout, estimate, model_counts

MIB = 2**20


def test_live_bytes_counts_new_storages_and_frees():
    weight = torch.randn(256, 256, requires_grad=True)  # made before the tape: never counted
    matrix = 256 * 256 * 4
    with LiveBytes() as tape:
        view = weight.t()
        weight.data.mul_(1.0)
        assert tape.current == 0  # views and in-place results own no new storage
        hidden = (weight @ weight).relu()  # the product dies once relu ran; relu's output is saved
        loss = hidden.sum()
        assert tape.peak == 2 * matrix and tape.current == matrix + 4
        del hidden, view
        assert tape.current == matrix + 4  # relu saved its output for backward
        loss.backward()
    assert tape.current >= matrix  # weight.grad was created inside
    peak, held, result = peak_bytes(lambda: torch.ones(1024).add(1))
    assert (peak, held, result.numel()) == (8192, 4096, 1024)


def test_windows_keep_each_window_s_peak_with_what_was_alive_when_it_opened():
    matrix = 64 * 64 * 4
    with LiveBytes() as tape:
        tape.mark("first")
        kept = torch.ones(64, 64)
        (torch.ones(64, 64) + 1).sum()  # a temporary: the first window's peak holds three matrices' bytes
        tape.mark("second")  # opens at the one kept matrix
        more = torch.ones(64, 64)
        tape.mark(None)
        torch.ones(256, 256)  # after the last window: in the peak, in no window
    assert tape.windows == {"first": 3 * matrix, "second": 2 * matrix}
    assert tape.peak == 256 * 256 * 4 + 2 * matrix and kept.numel() == more.numel()


def test_coefficients_are_the_fit_of_the_stored_measurements():
    record = load_calibration()
    points, coefficients = record["points"], record["coefficients"]
    assert fit(points["capture"], 2) == pytest.approx(coefficients["capture"], rel=1e-9)
    assert fit(points["captured"], 1) == pytest.approx(coefficients["captured"], rel=1e-9, abs=1e-3)
    assert [p[0] for p in points["moe"]] == list(MOE_TOKENS)
    assert coefficients["moe_pair"] == [pytest.approx(moe_pair(points["moe"], 6), rel=1e-12)]  # Flash: top-6
    assert [p[0] for p in points["engram"]] == list(ENGRAM_TOKENS)
    assert fit(points["engram"], 1) == pytest.approx(coefficients["engram"], rel=1e-9, abs=1e-3)
    assert fit(points["draft_step"]) == pytest.approx(coefficients["draft_step"], rel=1e-9)
    for window in DRAFT_WINDOWS:
        assert fit(points[f"draft {window}"]) == pytest.approx(coefficients[f"draft {window}"], rel=1e-9)
    # The timeline covers the step: at every point its largest window is the step's peak.
    for index, (anchors, tokens, peak) in enumerate(points["draft_step"]):
        assert max(points[f"draft {window}"][index][-1] for window in DRAFT_WINDOWS) == peak
        assert all(points[f"draft {window}"][index][:2] == [anchors, tokens] for window in DRAFT_WINDOWS)
    assert coefficients["draft_gradients"] == [max(p[-1] for p in points["draft_gradients"])]
    # Each measured point is reproduced by its fit within 2%, and so is each check row, never fitted.
    a, b, c = coefficients["capture"]
    for tokens, measured in points["capture"] + points["capture check"]:
        assert a + b * tokens + c * tokens * tokens == pytest.approx(measured, rel=0.02)
    a, b, c = coefficients["draft_step"]
    for anchors, tokens, measured in points["draft_step"]:
        assert a + b * anchors + c * tokens == pytest.approx(measured, rel=0.02)
    assert [p[0] for p in points["capture"]] == list(TOKENS)
    assert [tuple(p[:2]) for p in points["draft_step"]] == [tuple(step) for step in DRAFT_STEPS]
    # The check rows are stored where calibrate() puts them (no fit reads them).
    assert [p[0] for p in points["capture check"]] == [p[0] for p in points["captured check"]] == list(CHECK_TOKENS)


def test_enough_points_of_every_fitted_term_re_measure_to_the_stored_bytes(flash_widths_alone):
    """Flash widths on CPU (up to 13 GB resident; the suite's longest test, about 20 minutes of one core on a slow
    day): three capture rows (512, 1k and 2k tokens: the fit is quadratic, so three points pin its constant, slope
    and curvature; 512 is a stored check row, ``CHECK_TOKENS``), the draft step at 64 and 128 anchors (the slope
    in anchors) and at 2k and 4k tokens (the slope in tokens), counted again now, equal the
    shipped record byte for byte, and so do one MoE block's at two token counts (the bytes a routed pair costs,
    ``Estimate.imbalance``), one Engram block's at two (``Estimate.engram_block``) and the optimizer's state. A term
    whose slope drifts (as the draft's anchor slope did when the calibration stood in a fused SDPA for CUDA's math
    kernel) fails here."""
    record = load_calibration()
    points = record["points"]
    with cpu_stand_ins():
        target = build_calibration_target()
        rows = [(points["capture"][i], points["captured"][i]) for i in (0, 1)]
        for (tokens, peak), (_, captured) in [*rows, (points["capture check"][0], points["captured check"][0])]:
            measured = measure_capture(target, tokens)
            assert [tokens, measured["peak"], measured["captured"]] == [tokens, peak, captured]
        for index, tokens in enumerate(MOE_TOKENS):  # both points of the bytes a routed pair costs
            assert [tokens, measure_moe(target, tokens)] == points["moe"][index]
        assert target.model.layers[str(ENGRAM_LAYER)].engram is not None  # the capture ran one Engram block
        del target
        block = build_engram_block()
        for index, tokens in enumerate(ENGRAM_TOKENS):  # both points of the Engram block alone
            assert [tokens, measure_engram(block, tokens)] == points["engram"][index]
        del block
        gc.collect()
        trainer = build_calibration_draft(DRAFT_STEPS[0][0])
        for index in (0, 1, 3):  # (64, 2048), (128, 2048), (64, 4096): 158 s of one core, a 1,024-token step 144
            anchors, tokens = DRAFT_STEPS[index]
            measured = measure_draft_step(trainer, anchors, tokens)
            assert [anchors, tokens, measured["peak"]] == points["draft_step"][index]
            for window in DRAFT_WINDOWS:  # a window's peak holds CPU kernels' scratch: 60 kB of 2 GB moved by CPU
                assert points[f"draft {window}"][index][:2] == [anchors, tokens]
                assert measured["windows"][window] == pytest.approx(points[f"draft {window}"][index][2], rel=1e-3)
            assert measured["gradients"] == pytest.approx(points["draft_gradients"][index][-1], rel=1e-9)
        del trainer
        gc.collect()
    optimizer = measure_optimizer()
    assert optimizer["state"] == pytest.approx(record["coefficients"]["optimizer_state"][0], rel=1e-9)
    assert optimizer["transient"] == pytest.approx(record["coefficients"]["optimizer_transient"][0], rel=1e-9)


@pytest.fixture(scope="module")
def flash_counts():
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    return model_counts(DeepseekV41TextConfig())


def test_the_model_scales_the_measured_terms(flash_counts):
    calibration = Calibration.shipped()
    record = load_calibration()
    # At a measured point the model's phase term is the measurement (one row, CP 1, one document).
    tokens, measured = record["points"]["capture"][-1]
    layout = Layout(gpus=32, gpu_gib=141, ep=32, cp=1, rows=1, row_tokens=int(tokens), anchors_per_row=64)
    result = estimate(flash_counts, layout, calibration)
    assert result.phases["capture"]["capture activations (measured)"] == pytest.approx(measured, rel=0.02)
    # Under CP each rank holds its local tokens' activations and a 1/cp share of the anchors.
    a, b, c = calibration.capture
    wide = Layout(gpus=32, gpu_gib=141, ep=32, cp=4, rows=1, row_tokens=65536, anchors_per_row=2048)
    wide_result = estimate(flash_counts, wide, calibration)
    assert wide_result.phases["capture"]["capture activations (measured)"] == pytest.approx(
        a + b * 16384 + c * 16384 * 65536
    )
    a, b, c = calibration.draft_windows["loss"]
    columns = 16384 + 128 + 5
    assert wide_result.phases["draft loss"]["draft activations, logits and loss gradients (measured)"] == pytest.approx(
        a + b * 512 + c * columns
    )
    # The peak is the largest phase on top of what every phase holds.
    totals = {phase: wide_result.phase_total(phase) for phase in wide_result.phases}
    assert wide_result.total == max(totals.values()) and wide_result.peak_phase == max(totals, key=totals.get)


def test_other_widths_are_refused_by_name():
    from nemo_automodel_ext.models.deepseek_v41.tiny import tiny_target_config

    counts = model_counts(tiny_target_config().text_config, 8)
    layout = Layout(gpus=1, gpu_gib=80, ep=1, cp=1, rows=1, row_tokens=128, anchors_per_row=8)
    with pytest.raises(ValueError, match=r"calibrated at V4.1-Flash widths.*hidden 16 \(calibrated 5120\)"):
        estimate(counts, layout)
