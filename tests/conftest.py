"""Shared fixtures: the SM90 kernel switch, and per-test seeds."""

import pytest


@pytest.fixture(params=["earlier", "family"])
def sm90_kernels(request, monkeypatch):
    """Runs a GPU test once on each SM90 chunk kernel a launch can compile: the earlier kernels (served by default)
    and the family's (``CULA_SM90_FAMILY=1``), until the earlier ones are retired."""
    from cula.sm90.entry import FAMILY_SWITCH

    monkeypatch.setenv(FAMILY_SWITCH, "1" if request.param == "family" else "0")
    return request.param


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
