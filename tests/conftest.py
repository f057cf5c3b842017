"""Shared test set-up: hypothesis profiles.

``ci`` (the default) keeps the whole suite well inside CI's budget on 2 cores;
``thorough`` is for local runs: ``HYPOTHESIS_PROFILE=thorough pytest``.
"""
import importlib.util
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

# torchao (installed for torchtune's models, .ci/run) raises DeprecationWarnings when imported, and
# transformers imports it at the first model class it builds: import it once here, silently, so
# that no test checking the warnings of a parallelize sees them.
if importlib.util.find_spec("torchao") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao  # noqa: F401

settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
settings.register_profile(
    "thorough", max_examples=200, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "grad: run with autograd enabled (pm(x) trains)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """``pm(x)`` with grad enabled trains (the PyTorch contract), so the inference tests run
    under ``torch.no_grad()``, as inference is called; a training test (``test_train*``, or
    marked ``grad``, or a module with ``GRAD = True``) runs with grad enabled."""
    module = getattr(item, "module", None)
    if item.get_closest_marker("grad") or getattr(module, "GRAD", False) or \
            item.fspath.basename.startswith("test_train"):
        yield
        return
    with torch.no_grad():
        yield
