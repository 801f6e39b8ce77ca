"""Routing simulation for benchmarks: routing that ignores the logits, with a chosen load shape.

    uniform_random   every expert equally likely
    skewed           Zipf popularity: expert of rank r is chosen with probability ~ 1 / r**1.2

Each token gets k distinct experts; weights are random and positive (renormalized when asked).
The draw is seeded, so the same M gives the same routing on every call (benchmarks repeat).
Chosen by argument, or by the environment variable FUSEDMOE_ROUTING_SIMULATION, read when the
router is created.
"""

from __future__ import annotations

import os

import torch

from fusedmoe.router.base import Router, finish_weights

ENV_VAR = "FUSEDMOE_ROUTING_SIMULATION"
STRATEGIES = ("uniform_random", "skewed")
ZIPF_EXPONENT = 1.2


def simulation_from_env() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip()
    return value or None


def expert_popularity(num_experts: int, strategy: str) -> torch.Tensor:
    """Probability of each expert under `strategy`, float64 [E] summing to 1."""
    if strategy == "uniform_random":
        p = torch.ones(num_experts, dtype=torch.float64)
    else:
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** ZIPF_EXPONENT
    return p / p.sum()


class RoutingSimulatorRouter(Router):
    cuda_graph_safe = False

    def __init__(self, top_k: int, num_experts: int, *, strategy: str, seed: int = 0, **kwargs):
        super().__init__(top_k, num_experts, **kwargs)
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown routing simulation {strategy!r}; expected one of {STRATEGIES}"
            )
        self.strategy = strategy
        self.seed = seed

    def _select(self, x, logits, input_ids):
        num_tokens = logits.shape[0]
        gen = torch.Generator().manual_seed(self.seed)
        probs = expert_popularity(self.num_experts, self.strategy).expand(num_tokens, -1)
        if num_tokens == 0:
            ids = torch.empty(0, self.top_k, dtype=torch.int64)
        else:
            ids = torch.multinomial(probs, self.top_k, replacement=False, generator=gen)
        weights = torch.rand(num_tokens, self.top_k, generator=gen) + 0.05
        weights = finish_weights(weights, self.renormalize, self.routed_scaling_factor)
        return weights.to(logits.device), ids.to(logits.device)

    def __repr__(self) -> str:
        return f"RoutingSimulatorRouter(strategy={self.strategy}, top_k={self.top_k})"
