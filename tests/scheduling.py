"""How ``make test`` spreads the suite over its processes (pytest-xdist, ``--dist
loadgroup``), as a plugin that tests/conftest.py registers: the tests of a module that share
its servers run in one process, and the tests that start real processes go first.
tests/test_suite.py runs it on a small tree to check that the groups hold."""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The tests of a module that use its module- or class-scoped fixtures (its servers, a
    stack, a model) form one group (one per param of a parametrized one) that one process
    runs, so that those fixtures are set up once; every other test runs in whichever
    process is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        callspec = getattr(item, "callspec", None)
        shared, params = False, []
        for name in sorted(info.name2fixturedefs if info else ()):
            if info.name2fixturedefs[name][-1].scope in ("module", "class", "package"):
                shared = True
                if callspec is not None and name in callspec.indices:
                    params.append(f"{name}={callspec.indices[name]}")
        if shared:
            item.add_marker(pytest.mark.xdist_group(":".join([item.nodeid.split("::")[0], *params])))


def pytest_configure(config):
    config.pluginmanager.register(E2EFirst(), "kvservice-e2e-first")


class E2EFirst:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        """The tests that start real processes (marker ``e2e``) go first, the others after
        them, each part in the order collection gave it (random under pytest-randomly):
        under pytest-xdist the processes take the long tests first and the short ones fill
        the end, so that none starts a long test when the others are done."""
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None)
