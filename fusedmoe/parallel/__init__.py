"""Expert parallelism: how experts and tokens are spread over ranks.

    config        ParallelConfig (ep / dp sizes and ranks, dispatch kind, placement, EPLB)
    placement     where each expert lives (linear blocks, round robin, replicas) and expert_map
    eplb          expert load counting, rebalancing and moving the weights
    comm          the EP group's collectives (torch.distributed)
    naive_ep      NaiveEPPrepareFinalize: all-gather dispatch, reduce-scatter combine
    all_to_all_ep AllToAllEPPrepareFinalize: tokens to the ranks of their experts
    dp_dispatch   the all-gather dispatch of a backend that routes inside (monolithic)
    wiring        the layer's parallel parts: config checks, placement and its buffers, the
                  prepare/finalize and runner of a call, the DP dispatch

Importing this package does not import torch.distributed: only comm and the modules that
move tensors do, and wiring imports them when a dispatch is asked for.
"""

from fusedmoe.parallel.config import ParallelConfig, get_compressed_expert_map
from fusedmoe.parallel.placement import ExpertPlacement, expert_placement

__all__ = ["ExpertPlacement", "ParallelConfig", "expert_placement", "get_compressed_expert_map"]
