"""Exceptions of portep's own that a caller may want to tell apart (torch-free)."""


class DroppedInput(ValueError):
    """A call's kernels left part of its input out and said so (an expert index outside [-1, num_experts) in a GPU
    tensor, more received rows than num_worst_tokens). Raised once, on the rank whose input it was, by the call whose
    kernels reported it or by a later one, after that call's kernels were launched: every rank made the call, the
    Buffer is in step and stays usable. `results` holds what the raising call would have returned (None for a
    receive hook), so a caller that handles the error can go on with the matching calls."""

    def __init__(self, message: str, results: object = None) -> None:
        super().__init__(message)
        self.results = results


class NoEventError(RuntimeError, AssertionError):
    """EventOverlap.current_stream_wait() on an EventOverlap that holds no event (the operation ran without
    async_finish / async_with_compute_stream). DeepEP V1 raises RuntimeError there and V2 AssertionError; this is
    both."""
