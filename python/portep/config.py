"""Run-time settings shared by the Python layer: timeouts and transport choice from the environment."""

import os

DEFAULT_TIMEOUT_S = 100.0
TRANSPORTS = ("shm", "shm-unordered", "verbs", "verbs-striped")


def timeout_from_env(explicit=None):
    """The explicit value if given, else PORTEP_TIMEOUT_S, else 100 s."""
    if explicit is not None:
        value = float(explicit)
        source = "timeout_s"
    else:
        raw = os.environ.get("PORTEP_TIMEOUT_S")
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"PORTEP_TIMEOUT_S={raw!r} is not a number of seconds") from None
        source = "PORTEP_TIMEOUT_S"
    if not value > 0:
        raise ValueError(f"{source}={value} must be > 0 seconds")
    return value


def transport_from_env(explicit=None):
    name = explicit if explicit is not None else os.environ.get("PORTEP_TRANSPORT", "shm")
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r} is not available; choose one of {', '.join(TRANSPORTS)}")
    return name
