"""The V4.1 DSpark draft's cost against the packed row length, and supervision per captured token.

Run: ``.venv/bin/python benchmarks/draft_scaling.py [--rows 1024 4096 16384 32768] [--heads 64]``

1. Draft forward + backward at a fixed anchor count (default 128 anchors x block 4) on rows of
   growing length: median time and peak memory growth, before (upstream's dense
   ``DeepseekV41DSparkModel``: a [queries, row + queries] mask, every row token projected) and
   after (the plugin's windowed draft). Each case runs in a fresh process so its peak RSS is its
   own. Goals: after is flat within 1.5x from the shortest to the longest row; at 16k it is >= 5x
   faster with >= 10x less peak memory than dense. Dense rows above ``--dense-max-row`` are
   skipped (their memory is projected from the measured growth instead).
2. The attention core alone (one layer's queries against the compact context), per-anchor gather
   (what the draft runs) against ``torch.compile(flex_attention)`` with a block mask over the
   same keys: the reason the draft keeps the gather.
3. Supervised draft slots per captured target token on the tiny dataset: packed rows with the
   per-document anchor budget against unpacked rows with ``num_anchors`` per row. Goal: packed >= unpacked.

The model is the shipped tiny draft config widened to ``--heads`` attention heads (CPU, fp32).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import tempfile
import time

import torch

BLOCK_BUDGET = 24  # the tiny recipe's num_anchors


def _draft_options(heads: int, anchors: int):
    from nemo_automodel_ext.models.deepseek_v41.tiny import released_draft_options, tiny_target_config

    return released_draft_options(tiny_target_config(num_attention_heads=heads).text_config, anchors)


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def _draft_case(path: str, row: int, heads: int, anchors: int, repeats: int, queue) -> None:
    """One fresh process: build the draft, time fwd+bwd at ``row``, report (median s, peak growth MiB)."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
    from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

    from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
    from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend

    torch.manual_seed(0)
    options = _draft_options(heads, anchors)
    backend = cpu_backend(attn="sdpa", experts="torch")
    if path == "dense":
        model = DeepseekV41DSparkModel(
            options.text_config, backend=backend, num_anchors=anchors, enable_confidence_head=True
        )
    else:
        model = DeepseekV41PackedDSparkModel.from_options(options, backend=backend)
    text = options.text_config
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, text.vocab_size - 1, (1, row), generator=generator)
    features = torch.randn(1, row, text.hidden_size * len(text.dspark_target_layer_ids), generator=generator)
    last = torch.randn(1, row, text.hidden_size, generator=generator)
    loss_mask = torch.ones(1, row)

    def step() -> float:
        torch.manual_seed(5)  # same anchors on both paths
        start = time.perf_counter()
        output = model(input_ids, features, loss_mask, last)
        compute_dspark_loss(
            outputs=output, loss_decay_gamma=None, ce_loss_alpha=0.5, l1_loss_alpha=0.5, confidence_head_alpha=0.1
        ).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    base = _rss_kib()
    times = [step() for _ in range(repeats + 1)][1:]  # the first call compiles the MoE activation
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put((statistics.median(times), max(0, peak - base) / 1024))


def _isolated(*args) -> tuple[float, float]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_draft_case, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def draft_table(rows: list[int], heads: int, anchors: int, repeats: int, dense_max_row: int) -> None:
    print(f"\n1. draft fwd+bwd, {anchors} anchors x block 4, {heads} heads, fp32, {torch.get_num_threads()} threads")
    header = (
        f"{'row':>7} | {'dense s':>9} {'dense MiB':>10} | {'windowed s':>10} {'windowed MiB':>12} "
        f"| {'speed':>7} {'memory':>7}"
    )
    print(header + "\n" + "-" * len(header))
    after = {}
    for row in rows:
        windowed = _isolated("windowed", row, heads, anchors, repeats)
        after[row] = windowed
        if row <= dense_max_row:
            dense = _isolated("dense", row, heads, anchors, repeats)
            ratios = f"{dense[0] / windowed[0]:>6.1f}x {dense[1] / max(windowed[1], 1e-3):>6.1f}x"
            dense_cells = f"{dense[0]:>9.3f} {dense[1]:>10.0f}"
        else:
            dense_cells, ratios = f"{'skipped':>9} {'':>10}", ""
        print(f"{row:>7} | {dense_cells} | {windowed[0]:>10.3f} {windowed[1]:>12.0f} | {ratios}")
    first, last = after[rows[0]], after[rows[-1]]
    print(
        f"windowed, {rows[-1]} vs {rows[0]}: time x{last[0] / first[0]:.2f}, peak memory growth "
        f"{first[1]:.0f} -> {last[1]:.0f} MiB (goal: flat within 1.5x)"
    )


def attention_table(rows: list[int], heads: int, anchors: int, window: int = 128, block: int = 4, repeats: int = 15):
    """Per-anchor gather attention against compiled flex_attention on the same compact keys."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    head_dim = 16
    print(f"\n2. attention core, forward: {anchors} anchors x block {block}, window {window}, {heads} heads")
    header = f"{'row':>7} {'context':>8} | {'gather s':>9} | {'flex (compiled) s':>17} {'block mask s':>12}"
    print(header + "\n" + "-" * len(header))
    flex = torch.compile(flex_attention)
    queries = anchors * block
    for row in rows:
        generator = torch.Generator().manual_seed(0)
        context = min(row, anchors * window)
        q = torch.randn(1, heads, queries, head_dim, generator=generator)
        keys = torch.randn(1, 1, context + queries, head_dim, generator=generator)
        high = torch.linspace(window, context, anchors).long()
        low = (high - window).clamp_min(0)
        slots = (low.unsqueeze(1) + torch.arange(window)).clamp(max=context - 1)  # [anchors, window]

        def gather() -> torch.Tensor:
            window_keys = keys[0, 0, slots]  # [anchors, window, d]
            own = keys[0, 0, context:].view(anchors, block, head_dim)
            block_keys = torch.cat((window_keys, own), dim=1)  # [anchors, window + block, d]
            per_anchor = q[0].view(heads, anchors, block, head_dim).transpose(0, 1)
            return torch.nn.functional.scaled_dot_product_attention(
                per_anchor, block_keys.unsqueeze(1), block_keys.unsqueeze(1)
            )

        def mask_mod(batch, head, query, key):
            anchor = query // block
            in_window = (key < context) & (key >= low[anchor]) & (key < high[anchor])
            return in_window | ((key >= context) & ((key - context) // block == anchor))

        start = time.perf_counter()
        block_mask = create_block_mask(mask_mod, 1, None, queries, context + queries, device="cpu")
        mask_s = time.perf_counter() - start
        expanded = keys.expand(1, heads, -1, -1)
        flex(q, expanded, expanded, block_mask=block_mask)  # compile
        timings = {}
        for name, fn in (("gather", gather), ("flex", lambda: flex(q, expanded, expanded, block_mask=block_mask))):
            fn(), fn()
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            timings[name] = statistics.median(samples)
        print(f"{row:>7} {context:>8} | {timings['gather']:>9.4f} | {timings['flex']:>17.4f} {mask_s:>12.3f}")


def supervision_table(anchors: int = BLOCK_BUDGET) -> None:
    """Supervised slots per captured target token, packed (per-document budget) vs unpacked."""
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_dataloader
    from nemo_automodel.components.speculative.dspark.common import sample_anchor_positions

    from nemo_automodel_ext.demo.tiny_assets import build_tokenizer, ensure_tiny_assets
    from nemo_automodel_ext.models.deepseek_v41.anchors import block_supervision, compact_anchors, select_packed_anchors
    from nemo_automodel_ext.models.deepseek_v41.dspark_target import aligned_packed_layout

    with tempfile.TemporaryDirectory() as directory:
        assets = ensure_tiny_assets(f"{directory}/assets")
        tokenizer = build_tokenizer()
        rows = {}
        for mode, packed in (("unpacked", 0), ("packed", 128)):
            loader = build_eagle3_dataloader(
                data_path=str(assets / "train.jsonl"),
                tokenizer=tokenizer,
                seq_length=128,
                batch_size=4,
                shuffle=False,
                packed_sequence_size=packed,
            )
            slots = captured = real = 0
            torch.manual_seed(0)
            for batch in loader:
                loss_mask = batch["loss_mask"]
                if packed:
                    chosen = select_packed_anchors(loss_mask, batch["doc_remaining"], batch["seq_lens"], anchors)
                    anchor_columns, keep = compact_anchors(chosen)
                    layout = aligned_packed_layout(batch["seq_lens"], tuple(loss_mask.shape), 4, False)
                    captured += layout.source_indices.numel()
                    mask = block_supervision(anchor_columns, keep, loss_mask, 4, batch["doc_remaining"])[2]
                else:
                    anchor_columns, keep = sample_anchor_positions(
                        seq_len=loss_mask.shape[1], loss_mask=loss_mask, num_anchors=anchors, device="cpu"
                    )
                    captured += loss_mask.numel()  # the target runs every padded column
                    mask = block_supervision(anchor_columns, keep, loss_mask, 4)[2]
                slots += int(mask.sum())
                real += int(batch["attention_mask"].sum())
            rows[mode] = (slots, captured, real)
    print(f"\n3. supervised draft slots on the tiny dataset (block 4, {anchors} anchors per document / unpacked row)")
    header = f"{'rows':>9} | {'slots':>8} {'captured tokens':>16} {'real tokens':>12} | {'slots/captured':>14}"
    print(header + "\n" + "-" * len(header))
    for mode, (slots, captured, real) in rows.items():
        print(f"{mode:>9} | {slots:>8} {captured:>16} {real:>12} | {slots / captured:>14.3f}")
    ratio = (rows["packed"][0] / rows["packed"][1]) / (rows["unpacked"][0] / rows["unpacked"][1])
    print(f"packed / unpacked supervision per captured token: {ratio:.2f}x (goal: >= 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--anchors", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-max-row", type=int, default=16384, help="skip dense rows above this (memory)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["draft", "attention", "supervision"])
    args = parser.parse_args()
    if "draft" not in args.skip:
        draft_table(args.rows, args.heads, args.anchors, args.repeats, args.dense_max_row)
    if "attention" not in args.skip:
        attention_table(args.rows, args.heads, args.anchors)
    if "supervision" not in args.skip:
        supervision_table()


if __name__ == "__main__":
    main()
