"""Guard: find grey GPU nodes and stragglers in training jobs; manage node health."""

from importlib.metadata import PackageNotFoundError, version


def installed_version() -> str:
    """Guard's version as installed (``guard --version``, ``guard_build_info``)."""
    try:
        return version("guard-telemetry")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown"
