"""Shared fixtures."""

import pytest


@pytest.fixture(params=["earlier", "family"])
def sm90_kernels(request, monkeypatch):
    """Runs a GPU test once on each SM90 chunk kernel a launch can compile: the earlier kernels (served by default)
    and the family's (``CULA_SM90_FAMILY=1``), until the earlier ones are retired."""
    from cula.sm90.entry import FAMILY_SWITCH

    monkeypatch.setenv(FAMILY_SWITCH, "1" if request.param == "family" else "0")
    return request.param
