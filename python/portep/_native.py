"""Loads the native module once and says clearly why it is missing if it is."""

try:
    from . import _C as native  # noqa: N812

    native_error = None
except ImportError as exc:  # pragma: no cover - only on a broken install
    native = None
    native_error = (
        f"portep's native module could not be imported ({exc}); reinstall with `pip install .` "
        "from the source tree so the C++ core is built"
    )


def require_native():
    if native is None:
        raise ImportError(native_error)
    return native
