"""Shared fixtures: per-test seeds."""

import pytest


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test draws its random inputs from a seed of its own (its node id), so a failure reproduces alone and the
    inputs do not depend on which tests ran before it."""
    import random
    import zlib

    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)
    return seed
