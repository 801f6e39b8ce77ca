"""Plain top-k, top-k with a correction bias, and hash routing.

    scores  = score(logits)                                   # [M, E] float32
    ids     = topk(scores + bias, k)                          # bias only for selection
    weights = scores[ids]  (renormalized, times routed_scaling_factor)

Hash routing (a table lookup per input id) sits in the same slot of the factory as the bias:
    ids     = hash_indices_table[input_ids]                   # [M, k]
    weights = scores[ids]
The `*_ref` functions are per-token loops: the spec the vectorized versions are tested against.
The routers call `dispatch_topk_route`: on CUDA the same routing in one Triton launch
(fusedmoe.router.fused.fused_topk, whose twin is `topk_route`), else `topk_route`.
"""

from __future__ import annotations

import torch

from fusedmoe._checks import (
    INDEX_DTYPES,
    check_ids_in_range,
    check_tensor,
    value_checks_enabled,
)
from fusedmoe.router.base import (
    Router,
    ScoringFunc,
    compute_scores,
    finish_weights,
    use_fused_routing,
)
from fusedmoe.router.checks import check_bias


def topk_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (weights float32 [M, k], ids int64 [M, k])."""
    scores = compute_scores(logits, scoring)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    # A -inf logit scores 0, which a bias can lift or an underflowed finite score can tie:
    # mask it so it is never chosen while k finite experts remain (see router/base.py).
    choice = choice.masked_fill(logits.isneginf(), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return finish_weights(weights, renormalize, routed_scaling_factor), ids


def topk_route_ref(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    bias = [0.0] * num_experts if e_score_correction_bias is None else e_score_correction_bias
    for m in range(num_tokens):
        scores = compute_scores(logits[m : m + 1], scoring)[0].tolist()
        row = logits[m].float().tolist()
        choice = [
            float("-inf") if row[e] == float("-inf") else scores[e] + float(bias[e])
            for e in range(num_experts)
        ]
        order = sorted(range(num_experts), key=lambda e: -choice[e])
        chosen = order[:top_k]
        w = [scores[e] for e in chosen]
        if renormalize:
            total = sum(w)
            w = [v / total for v in w]
        weights[m] = torch.tensor([v * routed_scaling_factor for v in w])
        ids[m] = torch.tensor(chosen)
    return weights, ids


def dispatch_topk_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_route in one launch (fusedmoe.router.fused.fused_topk, ids int32) where
    `use_fused_routing` says so, else topk_route itself (ids int64)."""
    kwargs = dict(
        scoring=scoring,
        renormalize=renormalize,
        e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )
    if use_fused_routing(logits):
        from fusedmoe.router.fused import fused_topk

        return fused_topk(logits, top_k, **kwargs)
    return topk_route(logits, top_k, **kwargs)


class TopKRouter(Router):
    """Plain top-k of the scores."""

    def _select(self, x, logits, input_ids):
        return dispatch_topk_route(
            logits,
            self.top_k,
            scoring=self.scoring,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )


class BiasedTopKRouter(Router):
    """Top-k with an e_score_correction_bias (DeepSeek-V3 style) or a hash table.

    Exactly one of `e_score_correction_bias` [E] and `hash_indices_table` [vocab, k] is given.
    """

    def __init__(
        self,
        top_k: int,
        num_experts: int,
        *,
        e_score_correction_bias: torch.Tensor | None = None,
        hash_indices_table: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        super().__init__(top_k, num_experts, **kwargs)
        if (e_score_correction_bias is None) == (hash_indices_table is None):
            raise ValueError(
                "BiasedTopKRouter takes exactly one of e_score_correction_bias and "
                "hash_indices_table"
            )
        self.e_score_correction_bias = None
        self.hash_indices_table = None
        if e_score_correction_bias is not None:
            self.e_score_correction_bias = check_bias(e_score_correction_bias, self.num_logits)
        else:
            table = check_tensor(
                "hash_indices_table", hash_indices_table, ndim=2, dtypes=INDEX_DTYPES
            )
            if table.shape[1] != top_k:
                raise ValueError(
                    f"hash_indices_table must be [vocab, top_k={top_k}], got {tuple(table.shape)}"
                )
            check_ids_in_range("hash_indices_table", table, 0, self.num_logits, once=True)
            if table.shape[0] > 0 and table.sort(dim=1).values.diff(dim=1).eq(0).any():
                raise ValueError("hash_indices_table has a row that names the same expert twice")
            self.hash_indices_table = table
            self.needs_input_ids = True

    def _select(self, x, logits, input_ids):
        if self.hash_indices_table is None:
            return dispatch_topk_route(
                logits,
                self.top_k,
                scoring=self.scoring,
                renormalize=self.renormalize,
                e_score_correction_bias=self.e_score_correction_bias.to(logits.device),
                routed_scaling_factor=self.routed_scaling_factor,
            )
        return hash_route(
            logits,
            input_ids,
            self.hash_indices_table.to(logits.device),
            scoring=self.scoring,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )


def hash_route(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    hash_indices_table: torch.Tensor,
    *,
    scoring: ScoringFunc = ScoringFunc.SOFTMAX,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids = table[input_ids]; weights = the scores of those experts."""
    check_ids_in_range("input_ids", input_ids, 0, hash_indices_table.shape[0])
    rows = input_ids.long()
    if not value_checks_enabled(input_ids):  # unchecked: clamped, never read out of bounds
        rows = rows.clamp(0, hash_indices_table.shape[0] - 1)
    ids = hash_indices_table[rows].long()
    weights = compute_scores(logits, scoring).gather(1, ids)
    return finish_weights(weights, renormalize, routed_scaling_factor), ids


def hash_route_ref(logits, input_ids, hash_indices_table, *, scoring=ScoringFunc.SOFTMAX,
                   renormalize=True, routed_scaling_factor=1.0):  # fmt: skip
    num_tokens, top_k = logits.shape[0], hash_indices_table.shape[1]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for m in range(num_tokens):
        scores = compute_scores(logits[m : m + 1], scoring)[0]
        chosen = hash_indices_table[int(input_ids[m])].tolist()
        w = [float(scores[e]) for e in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights[m] = torch.tensor([v * routed_scaling_factor for v in w])
        ids[m] = torch.tensor(chosen)
    return weights, ids
