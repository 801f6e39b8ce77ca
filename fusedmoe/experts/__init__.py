"""Expert backends. Each declares its capabilities on its class; the oracle reads them."""

from fusedmoe.experts.monolithic import MonolithicExperts
from fusedmoe.experts.torch_ref import TorchExperts

__all__ = ["MonolithicExperts", "TorchExperts"]
