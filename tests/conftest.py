"""Shared fixtures: pools are always closed, so no thread outlives its test."""

import pytest

from tether.loop.fakes import FakePool


@pytest.fixture
def make_pool():
    pools: list[FakePool] = []

    def make(**kw) -> FakePool:
        pool = FakePool(**kw)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
