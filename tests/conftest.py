import os

from hypothesis import HealthCheck, settings

# CI runs derandomized with bounded examples so results are stable run to run.
settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
