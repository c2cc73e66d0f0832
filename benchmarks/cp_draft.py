"""CP draft cost: per-rank draft step and feature bytes at CP=1 and CP=2 (gloo), all-gather vs halo.

Run: ``.venv/bin/python benchmarks/cp_draft.py [--row 8192] [--documents 16] [--per-document 128] [--repeats 3]``

One packed row of ``--row`` tokens (``--documents`` equal documents) on the demo target's
config (hidden 64, 6 layers, random weights), the released draft options with
``--per-document`` anchors a document. Three ways to train the draft on it:

- CP=1: one rank captures the whole row and trains every anchor;
- CP=2 all-gather (the plugin before CP-native): each rank captures its shard, the features are
  all-gathered back to the whole row, and every rank trains every anchor;
- CP=2 halo (CP-native): each rank captures its shard, receives its halos point to point and
  trains its shard's anchors.

Per rank (the slowest): the draft step (feature exchange + draft forward + backward, median of
``--repeats``; the target forward is excluded), the bytes of the features and last hidden
states it holds, and its anchors. Goal: the halo step's draft time and feature bytes fall
about 1/cp of CP=1's; the all-gather step's do not. The last column counts host syncs of one whole
step (capture included) in the plugin's code (``host_syncs.py``); ``CP_DRAFT_SITES=1`` prints their
call sites. Goal: CP adds none.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _setup(args):
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    from nemo_automodel_ext.demo.demo_target import demo_target_config
    from nemo_automodel_ext.models.deepseek_v41.cp_trainer import PackedDSparkTrainerModule
    from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
    from nemo_automodel_ext.models.deepseek_v41.tiny import cpu_backend, released_draft_options

    torch.manual_seed(0)
    config = demo_target_config()
    target = DeepseekV41ForCausalLM(config, backend=cpu_backend()).eval()
    text = config.text_config
    per_document, row, documents = args.per_document, args.row, args.documents
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=per_document), anchors_per_document=per_document
    )
    draft.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    trainer = PackedDSparkTrainerModule(draft, loss_decay_gamma=2.0)
    lengths = [row // documents] * documents
    lengths[-1] += row - sum(lengths)
    seq_lens = torch.tensor([lengths])
    input_ids = torch.randint(4, text.vocab_size - 16, (1, row), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    remaining = torch.cat([torch.arange(n - 1, -1, -1) for n in lengths]).unsqueeze(0)
    loss_mask = torch.ones_like(input_ids)
    return target, trainer, (input_ids, loss_mask, positions, seq_lens, remaining)


def _draft_step(trainer, batch, features, last, shard=None, count: bool = True) -> int:
    """One draft forward + backward; returns the anchors this rank trained (0 unless ``count``)."""
    from nemo_automodel_ext.models.deepseek_v41.anchors import select_packed_anchors

    input_ids, loss_mask, positions, seq_lens, remaining = batch
    torch.manual_seed(7)
    metrics = trainer(input_ids, features, loss_mask, last, positions, seq_lens, remaining, shard=shard)
    metrics.loss.backward()
    trainer.zero_grad(set_to_none=True)
    if not count:
        return 0
    torch.manual_seed(7)
    selected = select_packed_anchors(loss_mask, remaining, seq_lens, trainer.draft_model.anchors_per_document)
    return int(selected.sum() if shard is None else shard.own_anchors(selected, seq_lens)[1].sum())


def _measure(args, mode: str, wrapper, trainer, batch) -> tuple[float, int, int]:
    """(median s of exchange + draft fwd/bwd, feature bytes held, anchors trained, plugin host syncs) on this rank.

    The gather mode's sync count is not measured (its step is the capture plus the CP=1 draft).
    """
    from nemo_automodel.components.models.deepseek_v41.cp import gather_sequence

    from nemo_automodel_ext.models.deepseek_v41.cp import dspark_packed_forward_cp
    from nemo_automodel_ext.models.deepseek_v41.cp_draft import draft_shard

    input_ids, loss_mask, positions, seq_lens, remaining = batch
    block, window = trainer.draft_model.config.dspark_block_size, trainer.draft_model.config.sliding_window
    if mode == "cp1":
        captured = wrapper.generate_batch(
            input_ids, torch.ones_like(input_ids), loss_mask, positions, seq_lens, remaining
        )

        def step():
            return captured.target_hidden_states, captured.target_last_hidden_states, None
    else:
        layouts = []
        captured, _ = wrapper._capture(
            lambda: (
                layouts.append(dspark_packed_forward_cp(wrapper.model, input_ids, seq_lens, wrapper.cp_mesh)[0])
                or (lambda values: values)
            )
        )
        features, norm = wrapper._features(captured), captured["norm"]
        group = wrapper.cp_mesh.get_group()

        def step():
            if mode == "gather":
                layout = layouts[0]
                return (
                    layout.restore(gather_sequence(features, group)),
                    layout.restore(gather_sequence(norm, group)),
                    None,
                )
            shard = draft_shard(layouts[0], group, window, block)
            return shard.exchange(features, "before"), shard.exchange(norm, "after"), shard

    from host_syncs import by_owner, count_host_syncs, owner

    # Host syncs of one whole step (capture included) in the plugin's code, by dispatch.
    with count_host_syncs() as counts:
        if mode == "cp1":
            wrapper.generate_batch(input_ids, torch.ones_like(input_ids), loss_mask, positions, seq_lens, remaining)
            _draft_step(trainer, batch, captured.target_hidden_states, captured.target_last_hidden_states, count=False)
        else:
            whole = wrapper.generate_shard_batch(
                input_ids, loss_mask, positions, seq_lens, remaining, before=window, after=block
            )
            if mode == "halo":
                _draft_step(
                    trainer,
                    batch,
                    whole.target_hidden_states,
                    whole.target_last_hidden_states,
                    whole.shard,
                    count=False,
                )
    syncs = by_owner(counts).get("plugin", 0)
    if os.environ.get("CP_DRAFT_SITES") and (not dist.is_initialized() or dist.get_rank() == 0):
        print(mode, {site: n for site, n in counts.items() if owner(site) == "plugin"}, flush=True)
    times, anchors, held = [], 0, 0
    for _ in range(args.repeats + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        local_features, local_last, shard = step()
        anchors = _draft_step(trainer, batch, local_features, local_last, shard)
        times.append(time.perf_counter() - start)
        held = local_features.nbytes + local_last.nbytes
    return statistics.median(times[1:]), held, anchors, syncs


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel

        target, trainer, batch = _setup(args)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        wrapper = DeepseekV41DSparkTargetModel(target, target.config.text_config.dspark_target_layer_ids, cp_mesh=mesh)
        for mode in ("gather", "halo"):
            result = torch.tensor(_measure(args, mode, wrapper, trainer, batch), dtype=torch.float64)
            gathered = [torch.zeros_like(result) for _ in range(2)]
            dist.all_gather(gathered, result)
            if rank == 0:
                queue.put((mode, [g.tolist() for g in gathered]))
    finally:
        dist.destroy_process_group()


def _single(args, queue) -> None:
    torch.set_num_threads(1)
    from nemo_automodel_ext.models.deepseek_v41.target_wrapper import DeepseekV41DSparkTargetModel

    target, trainer, batch = _setup(args)
    wrapper = DeepseekV41DSparkTargetModel(target, target.config.text_config.dspark_target_layer_ids)
    queue.put(("cp1", [list(_measure(args, "cp1", wrapper, trainer, batch))]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", type=int, default=8192)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--per-document", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    single = context.Process(target=_single, args=(args, queue))
    single.start()
    results = dict([queue.get()])
    single.join()
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = mp.start_processes(_worker, args=(args, port, queue), nprocs=2, join=False, start_method="spawn")
    results.update(dict(queue.get() for _ in range(2)))
    workers.join()

    print(
        f"one packed row of {args.row} tokens, {args.documents} documents, {args.per_document} anchors a document; "
        "demo target widths (hidden 64), 1 thread a rank"
    )
    header = (
        f"{'draft step':<28} {'ranks':>5} {'draft s/step (slowest rank)':>28} "
        f"{'features MiB/rank':>18} {'anchors/rank':>13} {'plugin syncs/step':>18}"
    )
    print(header + "\n" + "-" * len(header))
    labels = {"cp1": "CP=1", "gather": "CP=2 all-gather (before)", "halo": "CP=2 halo (CP-native)"}
    base = results["cp1"][0]
    for mode in ("cp1", "gather", "halo"):
        ranks = results[mode]
        seconds = max(r[0] for r in ranks)
        mib = max(r[1] for r in ranks) / 2**20
        anchors = "/".join(str(int(r[2])) for r in ranks)
        print(
            f"{labels[mode]:<28} {len(ranks):>5} {seconds:>19.3f} ({seconds / base[0]:.2f}x) "
            f"{mib:>11.2f} ({mib / (base[1] / 2**20):.2f}x) {anchors:>13} "
            f"{'-' if mode == 'gather' else int(max(r[3] for r in ranks)):>18}"
        )


if __name__ == "__main__":
    main()
