"""Shared fixtures: per-test seeds, and no device properties kept from one test to the next."""

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


@pytest.fixture(autouse=True)
def fresh_device_reads():
    """cuLA reads each device's properties once (:func:`cula.runtime.device_properties`); tests pretend to have other
    GPUs by patching torch.cuda, so each test starts and ends with nothing read."""
    from cula import runtime

    runtime.forget_devices()
    yield
    runtime.forget_devices()
