import os

import torch

# Without a GPU, Triton kernels run on its CPU interpreter; this must be set before triton loads.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# Routing simulation from the environment would replace every router under test.
os.environ.pop("FUSEDMOE_ROUTING_SIMULATION", None)
