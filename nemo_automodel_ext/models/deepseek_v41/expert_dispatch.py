"""All-to-all token dispatch for the draft's expert-parallel routed experts.

Upstream's ``GroupedExperts`` (``components/moe/experts.py``) runs expert parallelism by
all-gathering every EP member's tokens [E x tokens, hidden] and all-reducing the fp32 output of
that size: each rank receives every token of its group and sends an fp32 copy of all of them,
whatever the routing, so its traffic grows with the EP size. ``AllToAllGroupedExperts`` sends each
(token, chosen expert) pair only to the rank that holds the expert and brings the expert's output
back, as a token dispatcher does (HybridEP's kernels do the same on CUDA; this one is
``torch.distributed``'s all-to-all, so it also runs on gloo):

- forward, per layer: the routing counts ([E] int64, one host read), the pairs' activations
  [pairs, hidden] out and their expert outputs [pairs, hidden] back, both in the activation dtype,
  (E - 1) / E of them leaving the rank; backward sends the two gradients the same way;
- the routing weight multiplies each pair's output on the token's own rank (the expert is linear
  after its activation, so this equals upstream's weighted activation up to rounding), so weights
  and their gradients never travel;
- a rank that receives no pair still runs upstream's empty-expert path, so every parameter gets a
  gradient and the backward's all-to-alls run on every rank in the same order.

Equal to the draft alone for EP 2 and 4, and EP 2 x CP 2 (``tests/recipes/gloo_draft_ep.py``,
``tests/models/deepseek_v41/gloo_expert_dispatch.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from nemo_automodel.components.moe.experts import GroupedExperts
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor

#: ``recipe_args.draft_ep_dispatcher`` values: this module's all-to-all, or upstream's ``GroupedExperts`` EP.
DISPATCHERS = ("all_to_all", "all_gather")


def _local(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if tensor is None:
        return None
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).to(dtype)


class AllToAllGroupedExperts(GroupedExperts):
    """Upstream's ``GroupedExperts`` whose expert parallelism exchanges routed pairs all-to-all.

    Installed by ``use_all_to_all_dispatch`` on a module ``apply_ep`` has placed (parameters
    DTensors [experts, ...] sharded on dim 0 over a one-dimensional EP mesh); without EP it is
    upstream's module unchanged. Upstream's per-expert compute (``_forward_loop`` or
    ``_forward_grouped_mm``) runs on the received pairs, one routing choice each.
    """

    def forward(
        self, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """Route the local tokens' pairs to their experts' ranks and combine the outputs.

        Args:
            x: Activations [tokens, hidden]; not mutated.
            token_mask: [tokens] bool; masked tokens are routed nowhere and get zeros.
            weights: Routing weights [tokens, topk].
            indices: Global expert ids [tokens, topk] int64.

        Returns:
            [tokens, hidden] in ``x``'s dtype, a new tensor: sum over k of weights[:, k] times
            expert indices[:, k] applied to the token.
        """
        projs = self.gate_and_up_projs
        if not isinstance(projs, DTensor) or projs.device_mesh.size() == 1:
            return super().forward(x, token_mask, weights, indices)
        mesh = projs.device_mesh
        group, ep = mesh.get_group(), mesh.size()
        local_experts = self.n_routed_experts // ep
        tokens, topk = indices.shape
        # Pairs sorted by destination rank; masked tokens' pairs get destination ``ep`` (sorted last, never sent).
        keep = token_mask.bool().unsqueeze(-1).expand(tokens, topk).reshape(-1)
        flat = indices.reshape(-1)
        destination = torch.where(keep, torch.div(flat, local_experts, rounding_mode="floor"), ep)
        order = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=ep + 1)[:ep]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = torch.stack([send_counts, recv_counts]).tolist()  # the one host read
        order = order[: sum(send)]
        pair_token = torch.div(order, topk, rounding_mode="floor")
        expert_ids = torch.remainder(flat.index_select(0, order), local_experts)
        received_ids = expert_ids.new_empty(sum(recv))
        dist.all_to_all_single(received_ids, expert_ids, recv, send, group=group)
        received = all_to_all_single_autograd(x.index_select(0, pair_token), recv, send, group)

        outputs = self._expert_outputs(received, received_ids, local_experts)
        returned = all_to_all_single_autograd(outputs, send, recv, group)
        pair_weight = weights.reshape(-1).index_select(0, order).float().unsqueeze(-1)
        combined = x.new_zeros(tokens, x.size(1), dtype=torch.float32)
        combined = combined.index_add(0, pair_token, returned.float() * pair_weight)
        return combined.to(x.dtype)

    def _expert_outputs(self, received: torch.Tensor, expert_ids: torch.Tensor, local_experts: int) -> torch.Tensor:
        """Upstream's per-expert compute on the received pairs, unweighted.

        Args:
            received: [pairs, hidden] activations of the pairs this rank's experts serve.
            expert_ids: [pairs] int64 local expert ids (0 .. local_experts - 1).
            local_experts: Experts held by this rank.

        Returns:
            [pairs, hidden] in ``received``'s dtype, connected to ``received`` and to every local
            expert parameter even when ``pairs`` is 0.
        """
        pairs = received.size(0)
        dtype = received.dtype
        projections = (
            _local(self.gate_and_up_projs, dtype),
            _local(self.down_projs, dtype),
            _local(self.gate_up_proj_bias, dtype),  # None without expert_bias
            _local(self.down_proj_bias, dtype),
        )
        inputs, ids, mask = received, expert_ids, torch.ones(pairs, dtype=torch.bool, device=received.device)
        if pairs == 0:  # one masked zero row: upstream's empty-expert path keeps every parameter in the graph
            inputs = received.new_zeros(1, received.size(1))
            ids, mask = expert_ids.new_zeros(1), mask.new_zeros(1)
        ones = inputs.new_ones(inputs.size(0), 1, dtype=torch.float32)
        if self.use_torch_mm:
            y = self._forward_grouped_mm(inputs, mask, ones, ids.unsqueeze(-1), *projections, local_experts, 0)
        else:
            y = self._forward_loop(inputs, ones, ids.unsqueeze(-1), mask, *projections, local_experts, 0, local_experts)
        y = y.reshape(inputs.size(0), -1).to(dtype)
        if pairs == 0:
            return y[:0] + received.sum() * 0
        return y


def use_all_to_all_dispatch(experts: GroupedExperts) -> None:
    """Make an upstream ``GroupedExperts`` (before FSDP2 wraps it) dispatch all-to-all, in place.

    Args:
        experts: The module (its parameters and state unchanged; only its class is swapped, so
            state-dict keys and checkpoints are upstream's).
    """
    if type(experts) is not GroupedExperts:
        raise ValueError(
            f"draft_ep_dispatcher='all_to_all' needs upstream's GroupedExperts, got {type(experts).__name__}"
        )
    experts.__class__ = AllToAllGroupedExperts


__all__ = ["DISPATCHERS", "AllToAllGroupedExperts", "use_all_to_all_dispatch"]
