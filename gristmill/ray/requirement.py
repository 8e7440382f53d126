"""What the Ray runner needs installed, checked before any of it is imported."""

from __future__ import annotations


def require_ray():
    """`ray`, or an ImportError that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401 - both parts are needed
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"gristmill's Ray runner needs Ray Data and Ray Serve ({exc}); install them with "
                          f"pip install 'gristmill[ray]'") from exc
    return ray
