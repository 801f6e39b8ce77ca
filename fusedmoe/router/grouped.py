"""Grouped top-k (DeepSeek-V2/V3): choose groups of experts first, then experts inside them.

scores       = score(logits)                               # [M, E] float32
choice       = scores + bias  (or scores without a bias); -inf where the logit is -inf
group_score  = sum of the top-2 of `choice` in the group   if a bias is given
               max of `choice` in the group                otherwise       # [M, G]
kept groups  = topk(group_score, topk_group)
ids          = topk(choice restricted to kept groups, k)
weights      = scores[ids]  (renormalized, times routed_scaling_factor)

The router calls `dispatch_grouped_topk`: on CUDA the same routing in one Triton launch
(fusedmoe.router.fused.fused_grouped_topk, whose twin is `grouped_topk`), else grouped_topk.
"""

from __future__ import annotations

import torch

from fusedmoe.router.base import (
    Router,
    ScoringFunc,
    compute_scores,
    finish_weights,
    use_fused_routing,
)
from fusedmoe.router.checks import check_bias, check_groups


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (weights float32 [M, k], ids int64 [M, k])."""
    num_tokens, num_experts = logits.shape
    group_size = num_experts // num_expert_group  # explicit: view(..., -1) fails for M = 0
    scores = compute_scores(logits, scoring)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    # -inf logits are never chosen while k finite experts remain (see router/base.py).
    choice = choice.masked_fill(logits.isneginf(), float("-inf"))
    per_group = choice.view(num_tokens, num_expert_group, group_size)
    if e_score_correction_bias is not None:
        group_score = per_group.topk(min(2, group_size), dim=-1).values.sum(dim=-1)
    else:
        group_score = per_group.amax(dim=-1)  # [M, G]
    kept = group_score.topk(topk_group, dim=-1).indices  # [M, topk_group]
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(group_size, dim=1)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = masked.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return finish_weights(weights, renormalize, routed_scaling_factor), ids


def dispatch_grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_topk in one launch (fusedmoe.router.fused.fused_grouped_topk, ids int32)
    where `use_fused_routing` says so, else grouped_topk itself (ids int64)."""
    kwargs = dict(
        scoring=scoring,
        renormalize=renormalize,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )
    if use_fused_routing(logits):
        from fusedmoe.router.fused import fused_grouped_topk

        return fused_grouped_topk(logits, top_k, num_expert_group, topk_group, **kwargs)
    return grouped_topk(logits, top_k, num_expert_group, topk_group, **kwargs)


def grouped_topk_ref(
    logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    size = num_experts // num_expert_group
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for m in range(num_tokens):
        scores = compute_scores(logits[m : m + 1], scoring)[0].tolist()
        if e_score_correction_bias is None:
            choice = scores
        else:
            choice = [s + float(b) for s, b in zip(scores, e_score_correction_bias, strict=True)]
        row = logits[m].float().tolist()  # a -inf logit is never chosen (router/base.py)
        choice = [c if x != float("-inf") else x for x, c in zip(row, choice, strict=True)]
        group_scores = []
        for g in range(num_expert_group):
            if e_score_correction_bias is not None:
                group_scores.append(sum(sorted(choice[g * size : (g + 1) * size])[-2:]))
            else:
                group_scores.append(max(choice[g * size : (g + 1) * size]))
        groups = sorted(range(num_expert_group), key=lambda g: -group_scores[g])[:topk_group]
        candidates = [e for g in groups for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights[m] = torch.tensor([v * routed_scaling_factor for v in w])
        ids[m] = torch.tensor(chosen)
    return weights, ids


class GroupedTopKRouter(Router):
    def __init__(
        self,
        top_k: int,
        num_experts: int,
        *,
        num_expert_group: int,
        topk_group: int,
        e_score_correction_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        super().__init__(top_k, num_experts, **kwargs)
        check_groups(self.num_logits, top_k, num_expert_group, topk_group)
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.e_score_correction_bias = (
            None if e_score_correction_bias is None
            else check_bias(e_score_correction_bias, self.num_logits)
        )  # fmt: skip

    def _select(self, x, logits, input_ids):
        bias = self.e_score_correction_bias
        return dispatch_grouped_topk(
            logits,
            self.top_k,
            self.num_expert_group,
            self.topk_group,
            scoring=self.scoring,
            renormalize=self.renormalize,
            e_score_correction_bias=None if bias is None else bias.to(logits.device),
            routed_scaling_factor=self.routed_scaling_factor,
        )
