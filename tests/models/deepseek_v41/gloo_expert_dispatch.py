"""Worker for the all-to-all expert dispatch test (four gloo ranks, launched by tests/conftest.run_gloo).

Every rank builds the tiny draft's routed experts (4 experts, top 2) and, for each case, the
inputs of all four ranks from one seed: unequal token counts (rank 3 has none in one case),
masked tokens, and routings that are uniform, all to the first rank's experts (the others
receive nothing) or all to the last. The reference is upstream's module without EP on each EP
group's tokens concatenated. For EP 2 (two groups) and EP 4, the loop and grouped-mm compute,
and the router weight before and after the down projection, ``AllToAllGroupedExperts`` on
upstream's ``ExpertParallel`` placement must give each rank's output rows and the gradients of
its activations, its routing weights and its experts' parameter shards, without any all-gather,
send exactly the activations of its pairs routed elsewhere and the outputs of the pairs routed to
it, and leave its inputs unmutated. Upstream's all-gather EP passes the same checks (the harness).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch
import torch.distributed as dist
from gloo_exit import finish
from nemo_automodel.components.moe.parallelizer import ExpertParallel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from nemo_automodel_ext.models.deepseek_v41 import expert_dispatch
from nemo_automodel_ext.models.deepseek_v41.dspark_draft import DeepseekV41PackedDSparkModel
from nemo_automodel_ext.models.deepseek_v41.expert_dispatch import AllToAllGroupedExperts, use_all_to_all_dispatch
from nemo_automodel_ext.models.deepseek_v41.tiny import build_tiny_target, released_draft_options

ROUTINGS = ("uniform", "first", "last")


def inputs(seed: int, rank: int, hidden: int, experts: int, topk: int, routing: str, empty_rank: bool):
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    tokens = 0 if empty_rank and rank == 3 else 3 + 2 * rank
    x = torch.randn(tokens, hidden, generator=generator)
    mask = torch.rand(tokens, generator=generator) > 0.25
    scores = torch.rand(tokens, experts, generator=generator)
    if routing == "first":
        scores[:, experts // 2 :] -= 2  # only the first half of the experts (EP 2: rank 0's; EP 4: ranks 0-1)
    elif routing == "last":
        scores[:, :-1] -= 2
        scores[:, 0] += 1  # top 2: the last expert and the first
    weights, indices = scores.softmax(-1).topk(topk, dim=-1)
    grad_out = torch.randn(tokens, hidden, generator=generator)
    return x, mask, weights, indices, grad_out


def main() -> None:
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    text = build_tiny_target(seed=0).config.text_config
    torch.manual_seed(7)
    draft = DeepseekV41PackedDSparkModel.from_options(
        released_draft_options(text, num_anchors=8), anchors_per_document=8
    )
    base = draft.layers[0].mlp.experts
    with torch.no_grad():
        for param in base.parameters():
            param.normal_(0, 0.5)
    experts, topk, hidden = base.n_routed_experts, base.config.n_activated_experts, base.config.dim
    real_all_gather, real_all_to_all = dist.all_gather, expert_dispatch.all_to_all_single_autograd
    checked = 0
    for seed, (ep, grouped_mm, after_down, routing, empty_rank) in enumerate(
        [
            (2, False, False, "uniform", False),
            (4, False, False, "uniform", True),
            (4, True, False, "first", False),
            (2, True, True, "last", True),
            (4, False, True, "first", True),
            (4, False, False, "last", False),
        ]
    ):
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("rep", "ep"))["ep"]
        group = [r for r in range(world) if r // ep == rank // ep]
        per_rank = {r: inputs(seed, r, hidden, experts, topk, routing, empty_rank) for r in group}
        reference = copy.deepcopy(base)
        reference.use_torch_mm = grouped_mm
        reference.config = dataclasses.replace(reference.config, apply_router_weight_after_down=after_down)
        x_all = torch.cat([per_rank[r][0] for r in group]).requires_grad_()
        w_all = torch.cat([per_rank[r][2] for r in group]).requires_grad_()
        mask_all = torch.cat([per_rank[r][1] for r in group])
        idx_all = torch.cat([per_rank[r][3] for r in group])
        expected = reference(x_all, mask_all, w_all, idx_all)
        (expected * torch.cat([per_rank[r][4] for r in group])).sum().backward()
        start = sum(per_rank[r][0].size(0) for r in group if r < rank)
        rows = slice(start, start + per_rank[rank][0].size(0))

        for dispatcher in ("all_to_all", "all_gather"):
            label = f"EP {ep} {'grouped_mm' if grouped_mm else 'loop'} after_down={after_down} {routing} {dispatcher}"
            module = copy.deepcopy(reference)
            for param in module.parameters():
                param.grad = None
            if dispatcher == "all_to_all":
                use_all_to_all_dispatch(module)
                assert isinstance(module, AllToAllGroupedExperts)
            parallelize_module(module, mesh, ExpertParallel())
            x, mask, weights, indices, grad_out = per_rank[rank]
            originals = [t.clone() for t in (x, mask, weights, indices)]
            x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
            sent = []  # bytes each forward all-to-all of activations sends to other ranks
            if dispatcher == "all_to_all":

                def refuse(*args, **kwargs):
                    raise AssertionError("the all-to-all dispatcher all-gathered")

                def counted(tensor, output_splits, input_splits, group):
                    own = input_splits[mesh.get_local_rank()]
                    sent.append((tensor.size(0) - own) * tensor.size(1) * tensor.element_size())
                    return real_all_to_all(tensor, output_splits, input_splits, group)

                dist.all_gather = refuse
                expert_dispatch.all_to_all_single_autograd = counted
            try:
                out = module(x, mask, weights, indices)
                (out * grad_out).sum().backward()
            finally:
                dist.all_gather = real_all_gather
                expert_dispatch.all_to_all_single_autograd = real_all_to_all
            if dispatcher == "all_to_all":
                # Traffic: the activations of the pairs routed to other ranks out, the outputs of the pairs other
                # ranks routed here back, each [pairs, hidden] once a pass (what the memory model counts).
                me = mesh.get_local_rank()
                owner = [torch.div(per_rank[r][3][per_rank[r][1]], experts // ep, rounding_mode="floor") for r in group]
                out_pairs = int((owner[group.index(rank)] != me).sum())
                in_pairs = sum(int((owner[i] == me).sum()) for i, r in enumerate(group) if r != rank)
                assert sum(sent) == (out_pairs + in_pairs) * hidden * x.element_size(), (label, sent)
            for before, after in zip(originals, (x, mask, weights, indices)):
                assert torch.equal(before, after.detach()), label
            torch.testing.assert_close(out, expected[rows].detach(), atol=1e-5, rtol=1e-5, msg=label)
            torch.testing.assert_close(x.grad, x_all.grad[rows], atol=1e-5, rtol=1e-5, msg=label)
            torch.testing.assert_close(weights.grad, w_all.grad[rows], atol=1e-5, rtol=1e-5, msg=label)
            local = slice(mesh.get_local_rank() * experts // ep, (mesh.get_local_rank() + 1) * experts // ep)
            for name, param in module.named_parameters():
                theirs = dict(reference.named_parameters())[name].grad
                assert param.grad is not None, (label, name)
                torch.testing.assert_close(param.grad.to_local(), theirs[local], atol=1e-5, rtol=1e-5, msg=label)
            checked += 1
    if rank == 0:
        print(f"{checked} cases: outputs and gradients equal upstream's experts without EP")
    dist.barrier()


if __name__ == "__main__":
    main()
    finish()  # all checks passed: skip the interpreter's teardown (gloo_exit.py)
