"""``make gpu-check``: the plugin's figures measured on one GPU in one run of at most 10 minutes.

Run on a lent H200 (torch 2.11, transformers 5.17, no nemo_automodel: ``docs/testing.md`` says how the
missing wheels travel in ``.whl/``) from the repository root::

    python3 benchmarks/gpu_check.py --output outputs/gpu_check

``--device cpu --quick`` checks the script itself on CPU (CI does, ``tests/test_gpu_check.py``). Four sections,
each guarded (a section that fails records its error and the next one runs) and each skipped once the run's
``--budget-s`` is spent; ``gpu_check.json`` and ``gpu_check.md`` in ``--output`` are rewritten after every
section, so a run stopped at its limit still leaves what it measured:

- **memory** (c): CUDA peak allocated bytes above the weights of the capture (the 5-layer calibration target
  of ``planning/calibration.py``: one V4.1 layer of each kind at Flash widths) at 3 row lengths, with each
  layer's own peak, and of the Flash draft's step (3 layers, block 5) at 3 (anchors, tokens) points, next to
  ``calibration.json``'s fitted terms: model, measured, ratio; one Engram block alone at 2 token counts; and one
  target MoE block alone at 2 token counts against ``moe_pair`` (the routing-imbalance margin's bytes a routed
  pair, measured on CPU's torch experts path). Two points of every fitted slope are re-measured on the GPU. On
  CPU the measurement is ``LiveBytes``, the calibration's own counter.
- **draft_flops** (d): the Flash draft step's achieved TFLOP/s (``torch.utils.flop_counter`` FLOPs over CUDA
  event time, best of 3 after a warm-up) at two CP-native Flash points, against ``planning/step_time.py``'s
  assumed ``MFU`` x the GPU's dense bf16 peak.
- **recipe** (a): ``recipes/deepseek_v41/dspark_tiny_cpu.yaml`` for one epoch on this device (the framework CLI
  under torchrun, as ``make distill``), its steps, seconds and the exact greedy tau of its last validation.
- **capture** (b): ``benchmarks/gpu_capture.py``'s capture and indexer tables (upstream next to the plugin).

Stand-ins: TileLang's indexer-score and sparse-attention kernels are not on the lent image; the memory and
FLOP sections replace them by functions allocating exactly their outputs (``calibration.cpu_stand_ins``), so
attention's FLOPs are outside (d) and its tiles outside (c), as in the calibration. The MoE activation runs
eagerly. The target has 8 routed experts a layer, the draft 8 (Flash: 384 and 128): every token still meets
its top-6 (top-3), so per-token bytes and FLOPs are Flash's; fewer experts give each a bigger GEMM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("memory", "draft_flops", "recipe", "capture")
#: Seconds a section needs at least to be started (a section started later would pass the run's limit).
SECTION_MIN_S = {"memory": 60, "draft_flops": 45, "recipe": 120, "capture": 45}
#: (c)'s capture row lengths and draft-step (anchors, tokens) points: two of every fitted slope on the GPU. ``--quick``
#: checks the script with small rows and one draft step (each step costs about 30 s on CPU at Flash widths, whatever
#: its size); CI re-measures the fits themselves at their stored points (``tests/planning/test_calibration.py``).
MEMORY_TOKENS, QUICK_TOKENS = (2048, 4096, 8192), (128, 256)
MEMORY_STEPS, QUICK_STEPS = ((64, 2048), (256, 2048), (64, 8192)), ((8, 256),)
GIB = 2**30


class CudaPeak:
    """A ``mode`` for ``calibration.run_capture`` / ``run_draft_step``: CUDA bytes allocated at the peak of the
    block above those allocated when it was entered (``peak``), and the same for reserved bytes (``reserved``)."""

    def __enter__(self) -> CudaPeak:
        torch.cuda.synchronize()
        self.base, self.base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.base
        self.reserved = torch.cuda.max_memory_reserved() - self.base_reserved


def peak_mode(device: str):
    from nemo_automodel_ext.planning.allocations import LiveBytes

    return CudaPeak() if device == "cuda" else LiveBytes()


def polynomial(coefficients: list[float], x: float) -> float:
    return sum(c * x**k for k, c in enumerate(coefficients))


def layer_peaks(target, device: str) -> tuple[dict[int, int], list]:
    """Forward hooks recording each decoder layer's CUDA peak above what was allocated at its start (CUDA only)."""
    peaks: dict[int, int] = {}
    if device != "cuda":
        return peaks, []
    hooks = []
    layers = target.model.layers
    for index, layer in enumerate(layers.values() if hasattr(layers, "values") else layers):

        def before(module, args, index=index):
            torch.cuda.synchronize()
            module._gpu_check_base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

        def after(module, args, output, index=index):
            torch.cuda.synchronize()
            peaks[index] = torch.cuda.max_memory_allocated() - module._gpu_check_base

        hooks += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    return peaks, hooks


_DRAFTS: dict[str, Any] = {}


def calibration_draft(cal, device: str):
    """``calibration.build_calibration_draft`` on ``device``, built once for the memory and FLOP sections."""
    if device not in _DRAFTS:
        _DRAFTS[device] = cal.build_calibration_draft(64, device=device)
    return _DRAFTS[device]


def memory_section(device: str, quick: bool) -> dict[str, Any]:
    """(c): capture and draft-step peaks against ``calibration.json``'s fits (see the module docstring)."""
    from nemo_automodel_ext.planning import calibration as cal

    coefficients = cal.load_calibration()["coefficients"]
    tokens = QUICK_TOKENS if quick else MEMORY_TOKENS
    steps = QUICK_STEPS if quick else MEMORY_STEPS
    rows: list[dict[str, Any]] = []
    with cal.cpu_stand_ins(math_sdpa=device == "cpu"):
        target = cal.build_calibration_target(device=device)
        kinds = [f"ratio {r}" if r else "sliding" for r in target.config.text_config.compress_ratios[:5]]
        for count in tokens:
            mode = peak_mode(device)
            cal.run_capture(target, count, mode)  # the phase's peak (the result is dropped at once)
            peaks, hooks = layer_peaks(target, device)  # then each layer's own, in a second pass
            try:
                captured = cal.run_capture(target, count, contextlib.nullcontext())
            finally:
                for hook in hooks:
                    hook.remove()
            del captured
            model = polynomial(coefficients["capture"], count)
            rows.append(
                {
                    "phase": "capture",
                    "tokens": count,
                    "model_bytes": model,
                    "measured_bytes": mode.peak,
                    "ratio": mode.peak / model,
                    "reserved_bytes": getattr(mode, "reserved", None),
                    "layers": {f"{i} ({kinds[i]})": peak for i, peak in peaks.items()},
                }
            )
            print(f"capture {count} tokens: model {model / GIB:.2f} GiB, measured {mode.peak / GIB:.2f}", flush=True)
        topk = int(target.config.text_config.num_experts_per_tok)
        for count in tokens[:2]:  # the bytes a routed pair costs (the routing-imbalance margin)
            mode = peak_mode(device)
            cal.run_moe(target, count, mode)
            model = coefficients["moe_pair"][0] * count * topk
            rows.append(
                {
                    "phase": "one MoE block",
                    "tokens": count,
                    "model_bytes": model,
                    "measured_bytes": mode.peak,
                    "ratio": mode.peak / model,
                    "reserved_bytes": getattr(mode, "reserved", None),
                }
            )
            print(f"MoE block {count} tokens: model {model / GIB:.2f} GiB, measured {mode.peak / GIB:.2f}", flush=True)
        del target
        block = cal.build_engram_block(device=device)
        for count in tokens[:2]:  # one Engram block alone (Estimate.engram_block's measured transients)
            mode = peak_mode(device)
            cal.run_engram(block, count, mode)
            model = polynomial(coefficients["engram"], count)
            rows.append(
                {
                    "phase": "one Engram block",
                    "tokens": count,
                    "model_bytes": model,
                    "measured_bytes": mode.peak,
                    "ratio": mode.peak / model,
                    "reserved_bytes": getattr(mode, "reserved", None),
                }
            )
            print(f"Engram block {count} tokens: model {model / GIB:.2f} GiB, measured {mode.peak / GIB:.2f}")
        del block
        if device == "cuda":
            torch.cuda.empty_cache()
        trainer = calibration_draft(cal, device)
        for anchors, count in steps:
            mode = peak_mode(device)
            cal.run_draft_step(trainer, anchors, count, mode)
            a, b, c = coefficients["draft_step"]
            model = a + b * anchors + c * count
            rows.append(
                {
                    "phase": "draft_step",
                    "anchors": anchors,
                    "tokens": count,
                    "model_bytes": model,
                    "measured_bytes": mode.peak,
                    "ratio": mode.peak / model,
                    "reserved_bytes": getattr(mode, "reserved", None),
                }
            )
            print(
                f"draft step {anchors} anchors, {count} tokens: model {model / GIB:.2f} GiB, "
                f"measured {mode.peak / GIB:.2f}",
                flush=True,
            )
    return {"rows": rows, "counter": "torch.cuda.max_memory_allocated" if device == "cuda" else "LiveBytes"}


def time_draft_step(cal, trainer, anchors: int, count: int, device: str, quick: bool, peak_tflops: float) -> dict:
    """FLOPs (``FlopCounterMode``) and best seconds of one draft step after a warm-up (``quick``: the seconds of the
    counted run itself, which checks the script, not the speed)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    started = time.perf_counter()
    cal.run_draft_step(trainer, anchors, count, counter)
    flops = counter.get_total_flops()
    timings = [time.perf_counter() - started] if quick else []  # quick: the counted run's seconds (a script check)
    for _ in range(0 if quick else 4):  # on CUDA the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        cal.run_draft_step(trainer, anchors, count, contextlib.nullcontext())
        if device == "cuda":
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - started)
    best = min(timings[1:] or timings)
    tflops = flops / best / 1e12
    return {
        "anchors": anchors,
        "tokens": count,
        "flops": flops,
        "seconds": best,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if device == "cuda" else None,
    }


def draft_flops_section(device: str, quick: bool) -> dict[str, Any]:
    """(d): the draft step's achieved TFLOP/s against the step-time model's assumption."""
    from nemo_automodel_ext.planning import calibration as cal
    from nemo_automodel_ext.planning.step_time import GPUS, MFU

    # CP-native Flash points: a 64k row under CP 2 is 32k tokens a rank with 2048 / 2 anchors (the H200 recipe).
    # At b9f6ca8 (before the draft attention folded its heads) the 1024-anchor point ran out of 140 GB.
    points = ((8, 256),) if quick else ((512, 16384), (1024, 32768))
    peak_tflops = GPUS["H200"].bf16_tflops
    rows = []
    with cal.cpu_stand_ins(math_sdpa=device == "cpu"):
        trainer = calibration_draft(cal, device)
        for anchors, count in points:
            try:
                rows.append(time_draft_step(cal, trainer, anchors, count, device, quick, peak_tflops))
            except torch.OutOfMemoryError as error:  # a row of its own: the points measured before it stay
                torch.cuda.empty_cache()
                rows.append({"anchors": anchors, "tokens": count, "error": f"OOM: {str(error).splitlines()[0][:160]}"})
            print(rows[-1], flush=True)
    return {"rows": rows, "assumed_mfu": MFU, "peak_tflops": peak_tflops}


def recipe_section(device: str, quick: bool, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """(a): the tiny recipe for one epoch on ``device``; its steps, seconds and last greedy tau.

    ``timeout_s`` bounds the run (what is left of ``--budget-s``), except under ``quick``.
    """
    from nemo_automodel_ext.demo.tiny_assets import ensure_tiny_assets
    from nemo_automodel_ext.launch import torchrun_command

    started = time.perf_counter()
    assets = ensure_tiny_assets(workdir / "assets", train_samples=64 if quick else 6000)
    assets_s = time.perf_counter() - started
    run = workdir / "recipe"
    command = torchrun_command(
        REPO / "recipes/deepseek_v41/dspark_tiny_cpu.yaml",
        [
            f"--recipe_args.tiny_assets_dir={assets}",
            f"--recipe_args.target_model_name_or_path={assets / 'target'}",
            f"--recipe_args.train_data_path={assets / 'train.jsonl'}",
            f"--recipe_args.val_data_path={assets / 'val.jsonl'}",
            f"--recipe_args.output_dir={run}",
            f"--checkpoint.checkpoint_dir={run / 'checkpoints'}",
            "--recipe_args.num_epochs=1",
        ],
    )
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.perf_counter()
    try:
        # --quick checks the script (CI): bounded by nothing but the run itself, so a busy machine cannot fail it.
        limit = None if quick else max(30.0, timeout_s - assets_s)
        result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the run's limit after {time.perf_counter() - started:.0f} s"}
    seconds = time.perf_counter() - started
    if result.returncode:
        tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
        return {"error": f"exit {result.returncode}", "log_tail": tail}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    val = [r for r in records if r.get("split") == "val"]
    return {
        "assets_seconds": assets_s,
        "seconds": seconds,
        "steps": max((r.get("step", 0) for r in records), default=0),
        "greedy_tau": val[-1].get("greedy_tau") if val else None,
        "val_records": val,
        "last_train_record": train[-1] if train else None,
    }


def capture_section(device: str, quick: bool) -> dict[str, Any]:
    """(b): ``gpu_capture.py``'s two tables (smaller sizes than its own run, to fit the kit's 10 minutes)."""
    from gpu_capture import capture_rows, indexer_rows, tilelang_available

    attn = "tilelang" if device == "cuda" and tilelang_available() else "eager"
    row, documents = (512, [1, 64]) if quick else (8192, [1, 64, 512])
    return {
        "attn": attn,
        "capture": capture_rows(device, attn, row, documents, 1 if quick else 3),
        "indexer": indexer_rows(
            device, attn, [4096] if quick else [16384, 65536], 16 if quick else 256, 1 if quick else 3
        ),
    }


def commit() -> str:
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gib(value: float | None) -> str:
    return "" if value is None else f"{value / GIB:.2f}"


def markdown(record: dict[str, Any]) -> str:
    """The record as the markdown tables docs/gpu_check.md quotes."""
    lines = [
        f"# gpu-check on {record['device_name']}",
        "",
        f"commit `{record['commit']}`, torch {record['torch']}, {record['when']}, device {record['device']}"
        f"{', --quick' if record['quick'] else ''}; {record['seconds']:.0f} s",
        "",
    ]
    sections = record["sections"]
    for name in SECTIONS:
        section = sections.get(name)
        if section is None:
            lines += [f"## {name}: not run", ""]
            continue
        if "error" in section or "skipped" in section:
            lines += [f"## {name}: {section.get('error') or section['skipped']}", ""]
            lines += [f"    {line}" for line in section.get("log_tail", [])] + [""]
            continue
        if name == "memory":
            lines += [
                f"## (c) Memory: model (calibration.json) against measured ({section['counter']})",
                "",
                "| phase | anchors | tokens | model GiB | measured GiB | measured / model | reserved GiB |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for row in section["rows"]:
                lines.append(
                    f"| {row['phase']} | {row.get('anchors', '')} | {row['tokens']} | {gib(row['model_bytes'])} "
                    f"| {gib(row['measured_bytes'])} | {row['ratio']:.3f} | {gib(row['reserved_bytes'])} |"
                )
            layered = [row for row in section["rows"] if row.get("layers")]
            if layered:
                lines += ["", "Each capture layer's own peak above its input (GiB):", ""]
                names = list(layered[0]["layers"])
                lines += ["| tokens | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
                for row in layered:
                    lines.append(f"| {row['tokens']} | " + " | ".join(gib(row["layers"][n]) for n in names) + " |")
        elif name == "draft_flops":
            lines += [
                f"## (d) Draft step: achieved TFLOP/s (model assumes MFU {section['assumed_mfu']:.2f} of "
                f"{section['peak_tflops']:.0f})",
                "",
                "| anchors | tokens | TFLOP | ms | TFLOP/s | MFU |",
                "| ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for row in section["rows"]:
                if "error" in row:
                    lines.append(f"| {row['anchors']} | {row['tokens']} | {row['error']} | | | |")
                    continue
                mfu = "" if row["mfu"] is None else f"{row['mfu']:.3f}"
                lines.append(
                    f"| {row['anchors']} | {row['tokens']} | {row['flops'] / 1e12:.2f} | {row['seconds'] * 1e3:.0f} "
                    f"| {row['tflops']:.1f} | {mfu} |"
                )
        elif name == "recipe":
            tau = section["greedy_tau"]
            lines += [
                "## (a) Tiny recipe, one epoch",
                "",
                f"{section['steps']} steps in {section['seconds']:.0f} s (assets {section['assets_seconds']:.0f} s); "
                f"greedy tau {'n/a' if tau is None else f'{tau:.2f}'} on the held-out prompts",
            ]
        elif name == "capture":
            lines += [
                f"## (b) Capture and indexer (attention {section['attn']})",
                "",
                "| docs | impl | ms / 1k tok | host reads | ops | peak GiB |",
                "| ---: | --- | ---: | ---: | ---: | ---: |",
            ]
            for row in section["capture"]:
                cells = (
                    [row.get("error", "")]
                    if "error" in row
                    else [f"{row['ms_per_1k']:.2f}", str(row["host_reads"]), str(row["ops"]), f"{row['peak_gib']:.2f}"]
                )
                lines.append(f"| {row['docs']} | {row['impl']} | " + " | ".join(cells) + " |")
            lines += ["", "| row | impl | ms | peak GiB |", "| ---: | --- | ---: | ---: |"]
            for row in section["indexer"]:
                cells = [row["error"], ""] if "error" in row else [f"{row['ms']:.2f}", f"{row['peak_gib']:.2f}"]
                lines.append(f"| {row['row'] // 1024}k | {row['impl']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write(record: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (output / "gpu_check.md").write_text(markdown(record))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small sizes: check the script, not the GPU")
    parser.add_argument("--output", default="outputs/gpu_check", help="folder of gpu_check.json and gpu_check.md")
    parser.add_argument("--workdir", help="the recipe's assets and run (default: OUTPUT/work)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="no section starts after this many seconds")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (use --device cpu --quick to check the script)")
    output = Path(args.output)
    if output.is_file():
        parser.error(f"--output {output} is a file; pass a folder")
    from nemo_automodel_ext.quiet import install_quiet_filters, quiet_sglang_warning

    install_quiet_filters(cpu_only=args.device == "cpu")
    quiet_sglang_warning()  # the calibration target's feature layers include its last: it is never served
    started = time.perf_counter()
    record: dict[str, Any] = {
        "commit": commit(),
        "torch": torch.__version__,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
        "seconds": 0.0,
        "sections": {},
    }
    for name in sections:
        left = args.budget_s - (time.perf_counter() - started)
        if left < SECTION_MIN_S[name] and not args.quick:
            record["sections"][name] = {"skipped": f"skipped: {left:.0f} s of the budget left"}
            continue
        print(f"\n== {name} ({left:.0f} s of the budget left)", flush=True)
        try:
            if name == "memory":
                result = memory_section(args.device, args.quick)
            elif name == "draft_flops":
                result = draft_flops_section(args.device, args.quick)
            elif name == "recipe":
                result = recipe_section(args.device, args.quick, Path(args.workdir or output / "work"), left)
            else:
                result = capture_section(args.device, args.quick)
        except Exception as error:  # a kit section, not a test: record it and go on to the next
            import traceback

            result = {
                "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}",
                "log_tail": traceback.format_exc().splitlines()[-12:],
            }
        if name == "draft_flops":
            _DRAFTS.clear()  # the last section that uses it
        if args.device == "cuda":
            torch.cuda.empty_cache()
        record["sections"][name] = result
        record["seconds"] = time.perf_counter() - started
        write(record, output)
    print("\n" + markdown(record), flush=True)
    failed = [name for name, section in record["sections"].items() if "error" in section]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
