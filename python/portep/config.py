"""Run-time settings shared by the Python layer: timeouts, transport choice and proxy spinning from the
environment."""

import os

DEFAULT_TIMEOUT_S = 100.0
TRANSPORTS = ("shm", "shm-unordered", "verbs", "verbs-striped")


DEFAULT_GPU_PROXY_SPIN_US = 1000.0


def _env_number(name, unit):
    """The environment variable as a float, None when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of {unit}") from None


def timeout_from_env(explicit=None):
    """The explicit value if given, else PORTEP_TIMEOUT_S, else 100 s."""
    if explicit is not None:
        value = float(explicit)
        source = "timeout_s"
    else:
        value = _env_number("PORTEP_TIMEOUT_S", "seconds")
        if value is None:
            return DEFAULT_TIMEOUT_S
        source = "PORTEP_TIMEOUT_S"
    if not value > 0:
        raise ValueError(f"{source}={value} must be > 0 seconds")
    return value


def proxy_spin_us_from_env(explicit, on_gpu):
    """How long an idle proxy busy-polls: the explicit value, else PORTEP_PROXY_SPIN_US, else 1000 us on a GPU
    (a sleeping proxy adds its wake-up to every hop of a kernel's command) and 0 on the host (spinning threads
    take the CPUs the ranks need)."""
    value = explicit if explicit is not None else _env_number("PORTEP_PROXY_SPIN_US", "microseconds")
    if value is None:
        value = DEFAULT_GPU_PROXY_SPIN_US if on_gpu else 0.0
    if not 0 <= value <= 1e6:
        raise ValueError(f"idle_spin_us={value} must be within [0, 1e6] microseconds")
    return float(value)


def transport_from_env(explicit=None):
    name = explicit if explicit is not None else os.environ.get("PORTEP_TRANSPORT", "shm")
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r} is not available; choose one of {', '.join(TRANSPORTS)}")
    return name
