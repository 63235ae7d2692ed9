"""Hypothesis profiles: ``ci`` (default) and ``gpu`` (600 examples; KVADDR_HYPOTHESIS_PROFILE=gpu)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", deadline=None, max_examples=600, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVADDR_HYPOTHESIS_PROFILE", "ci"))
