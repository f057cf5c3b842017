"""Shared test set-up: hypothesis profiles; ``export_once`` for modules that parallelize the
same models over many meshes.

``ci`` (the default) keeps the whole suite well inside CI's budget on 2 cores;
``thorough`` is for local runs: ``HYPOTHESIS_PROFILE=thorough pytest``.
"""
import dataclasses
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


@pytest.fixture(scope="module")
def export_once():
    """For a module that parallelizes the same (unchanged) models over many meshes: torch.export
    runs once per (model object, input signature, trace options) and each parallelize gets a
    fresh copy of the exported graph; every pass still runs on every build. Most of a small
    model's parallelize is its export. Opt in with ``pytestmark =
    pytest.mark.usefixtures("export_once")`` and build each model once (a module-level cache):
    the memo keys on the model object, so a fresh model traces anew, and it holds the model
    so its id is never reused. The product traces on every build, and so does every module
    that does not opt in."""
    import fxshard.passes.pipeline as pipeline
    import fxshard.runtime.program_cache as cache
    real, memo = pipeline.trace, {}

    def trace(model, args, kwargs=None, **options):
        key = (id(model), cache.signature(torch.utils._pytree.tree_flatten((args, kwargs))[0]),
               tuple(sorted((kwargs or {}))), tuple(sorted(options.items())))
        if key not in memo:
            memo[key] = (model, real(model, args, kwargs, **options))
        traced = memo[key][1]
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(traced.gm.graph, {}))
        return dataclasses.replace(traced, gm=torch.fx.GraphModule(traced.gm, graph))

    pipeline.trace = trace
    yield memo
    pipeline.trace = real
    memo.clear()
