"""Shared test set-up: hypothesis profiles.

``ci`` (the default) keeps the whole suite well inside CI's budget on 2 cores;
``thorough`` is for local runs: ``HYPOTHESIS_PROFILE=thorough pytest``.
"""
import importlib.util
import os
import warnings

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
