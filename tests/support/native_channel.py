"""A native portep Channel (portep._C.Channel) with small test defaults, for tests that drive the native layer
directly; keywords override any default."""

DEFAULTS = dict(
    rank=0,
    num_ranks=1,
    nbytes=4096,
    transport="shm",
    num_proxy_threads=1,
    num_fifos=1,
    fifo_capacity=64,
    num_streams=1,
    max_inflight_cmds=8,
    max_inflight_bytes=1 << 20,
    timeout_s=5.0,
    unordered_window=8,
    seed=0,
    skip_ordering=False,
)


def native_channel(**overrides):
    """native.Channel(**DEFAULTS updated with overrides): not connected."""
    from portep import native

    return native.Channel(**{**DEFAULTS, **overrides})
