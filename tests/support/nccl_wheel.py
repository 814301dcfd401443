"""The nvidia-nccl-cu12 wheel the nccl extra installs (CI installs it): its version, for the NCCL tests."""

import importlib.metadata
from typing import Optional


def wheel_version() -> Optional[str]:
    """The installed nvidia-nccl-cu12's version ("2.32.3"), or None."""
    try:
        return importlib.metadata.version("nvidia-nccl-cu12")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_code(text: str) -> int:
    """NCCL's version code of "X.Y.Z": X * 10000 + Y * 100 + Z."""
    major, minor, patch = (int(v) for v in text.split(".")[:3])
    return major * 10000 + minor * 100 + patch
