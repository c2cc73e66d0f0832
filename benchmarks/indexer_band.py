"""One V4.1 indexer layer (scores + top-k selection) on a long packed row: upstream's forward vs the plugin's.

Run: ``.venv/bin/python benchmarks/indexer_band.py [--rows 16384 65536 131072] [--documents 256] [--ratio 4]``

One frozen candidate-source indexer layer that owns its keys (the heaviest kind: keys, scores, candidate
blocks and top-k), BF16, the tiny config's head shape (2 index heads of 8) with ``index_topk`` 64,
``candidate_topk_blocks`` 16 of 8 keys, on one packed row of ``--rows`` tokens split into ``--documents``
equal documents:

- **upstream**: nemo_automodel 0.7.0's ``_Indexer.forward``: scores of every query against every key
  (``[row, row / ratio]`` plus the einsum's per-head intermediate and the boolean masks), then its
  per-document selection loop;
- **plugin**: ``models/deepseek_v41/packed_indexer.py``: upstream's scoring on bands of keys, the
  segmented selection.

Each case runs in a fresh process: seconds (best of ``--repeats``) and peak memory (the process's
resident high-water mark after the call minus before it; the inputs are built first). Upstream's
cases whose whole-row tensors would not fit in this machine's memory (by the count printed) are not
run. Goal (issue 18): at 64k rows with 256 documents, at least 10x faster with 10x less peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def build(ratio: int, row: int, documents: int, plugin: bool, device: str = "cpu", attn_backend: str = "eager"):
    """One candidate-source indexer layer (BF16, random weights) and its inputs on ``device``."""
    from nemo_automodel.components.models.deepseek_v41 import attention as upstream_attention

    from nemo_automodel_ext.models.deepseek_v41.packed_indexer import install_packed_indexer
    from nemo_automodel_ext.models.deepseek_v41.tiny import tiny_target_config

    text = tiny_target_config(
        compress_ratios=[0, 0, ratio, ratio, ratio, 0],
        kv_source_layer_ids=[2],
        index_source_layer_ids=[2, 4],
        candidate_source_layer_id=2,
        index_topk=64,
        candidate_topk_blocks=16,
        candidate_block_size=8,
        dspark_target_layer_ids=[1, 3],
    ).text_config
    torch.manual_seed(0)
    layer = upstream_attention._Indexer(text, layer_idx=2, dtype=torch.bfloat16, attn_backend=attn_backend)
    for parameter in layer.parameters():
        parameter.normal_()
    layer.to(device)
    if plugin:
        install_packed_indexer(layer)
    length = row // documents
    ids = torch.arange(1, documents + 1).repeat_interleave(length)
    ids = torch.cat([ids, torch.zeros(row - ids.numel(), dtype=torch.long)]).unsqueeze(0)
    width = row // ratio
    state = upstream_attention.DeepseekV41AttentionState(
        compressed_valid=(ids[:, : width * ratio].view(1, width, ratio) > 0).all(-1),
        compressed_seq_ids=ids[:, : width * ratio : ratio],
        compression_ratio=ratio,
    )
    pairs = text.qk_rope_head_dim // 2
    inputs = dict(
        hidden_states=torch.randn(1, row, text.hidden_size, dtype=torch.bfloat16),
        query_latent=torch.randn(1, row, text.q_lora_rank, dtype=torch.bfloat16),
        latent=torch.randn(1, width, text.head_dim, dtype=torch.bfloat16),
        angles=torch.rand(1, row, pairs),
        compressed_angles=torch.rand(1, width, pairs),
        position_ids=torch.arange(row).unsqueeze(0),
        packed_seq_ids=ids,
    )
    inputs = {name: value.to(device) for name, value in inputs.items()}
    inputs["state"] = upstream_attention.DeepseekV41AttentionState(
        compressed_valid=state.compressed_valid.to(device),
        compressed_seq_ids=state.compressed_seq_ids.to(device),
        compression_ratio=ratio,
    )
    return layer, inputs, text


def upstream_bytes(row: int, ratio: int, heads: int) -> int:
    """Upstream's largest live set by count: the BF16 einsum product and its ReLU/weighted copies."""
    return 3 * row * heads * (row // ratio) * 2


def case(impl: str, row: int, documents: int, ratio: int, repeats: int) -> dict:
    layer, inputs, _ = build(ratio, row, documents, impl == "plugin")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        layer(**inputs)
        seconds.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"seconds": min(seconds), "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16384, 65536, 131072])
    parser.add_argument("--documents", type=int, default=256)
    parser.add_argument("--ratio", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", nargs=2, metavar=("IMPL", "ROW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        impl, row = args.case[0], int(args.case[1])
        print(json.dumps(case(impl, row, args.documents, args.ratio, args.repeats)))
        return

    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"torch threads: {torch.get_num_threads()}, memory {available / 2**30:.0f} GiB, ratio {args.ratio}")
    header = (
        f"{'row':>7} {'docs':>5} | {'upstream s':>10} {'peak GiB':>9} | {'plugin s':>9} {'peak GiB':>9} |"
        f" {'faster':>7} {'less memory':>11}"
    )
    print(header)
    print("-" * len(header))
    gib = 2**30
    for row in args.rows:
        results = {}
        for impl in ("upstream", "plugin"):
            if impl == "upstream" and upstream_bytes(row, args.ratio, 2) > 0.6 * available:
                results[impl] = None
                continue
            command = [sys.executable, __file__, "--case", impl, str(row), "--documents", str(args.documents)]
            command += ["--ratio", str(args.ratio), "--repeats", str(args.repeats)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[impl] = json.loads(out.strip().splitlines()[-1])
        up, ours = results["upstream"], results["plugin"]
        if up is None:
            need = upstream_bytes(row, args.ratio, 2) / gib
            print(
                f"{row:>7} {args.documents:>5} | {'not run':>10} {f'>{need:.0f}':>9} | {ours['seconds']:>9.3f} "
                f"{ours['peak_bytes'] / gib:>9.3f} | upstream needs >{need:.0f} GiB by count"
            )
            continue
        print(
            f"{row:>7} {args.documents:>5} | {up['seconds']:>10.3f} {up['peak_bytes'] / gib:>9.3f} | "
            f"{ours['seconds']:>9.3f} {ours['peak_bytes'] / gib:>9.3f} | {up['seconds'] / ours['seconds']:>6.1f}x "
            f"{up['peak_bytes'] / max(ours['peak_bytes'], 1):>10.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
