"""DeepEP V2's experimental methods (Engram, pipeline send/receive, all-gather sessions), which portep does not
implement: each raises NotImplementedError naming itself."""

from typing import Any, NoReturn


def _missing(name: str, family: str) -> NoReturn:
    raise NotImplementedError(
        f"ElasticBuffer.{name}: {family} is experimental in DeepEP V2 and not implemented by portep "
        f"(dispatch and combine are)"
    )


class ExperimentalMethods:
    """The experimental part of ElasticBuffer's surface."""

    def engram_write(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (Engram): raises NotImplementedError."""
        _missing("engram_write", "Engram")

    def engram_fetch(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (Engram): raises NotImplementedError."""
        _missing("engram_fetch", "Engram")

    @staticmethod
    def get_engram_storage_size_hint(*args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (Engram): raises NotImplementedError."""
        _missing("get_engram_storage_size_hint", "Engram")

    def pp_set_config(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (pipeline send/receive): raises NotImplementedError."""
        _missing("pp_set_config", "pipeline send/receive")

    def pp_send(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (pipeline send/receive): raises NotImplementedError."""
        _missing("pp_send", "pipeline send/receive")

    def pp_recv(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (pipeline send/receive): raises NotImplementedError."""
        _missing("pp_recv", "pipeline send/receive")

    @staticmethod
    def get_pp_buffer_size_hint(*args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (pipeline send/receive): raises NotImplementedError."""
        _missing("get_pp_buffer_size_hint", "pipeline send/receive")

    def agrs_set_config(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("agrs_set_config", "all-gather/reduce-scatter")

    def create_agrs_session(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("create_agrs_session", "all-gather/reduce-scatter")

    def destroy_agrs_session(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("destroy_agrs_session", "all-gather/reduce-scatter")

    def agrs_new_session(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("agrs_new_session", "all-gather/reduce-scatter")

    def agrs_get_inplace_tensor(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("agrs_get_inplace_tensor", "all-gather/reduce-scatter")

    def all_gather(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("all_gather", "all-gather/reduce-scatter")

    @staticmethod
    def get_agrs_num_max_session_bytes(*args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("get_agrs_num_max_session_bytes", "all-gather/reduce-scatter")

    @staticmethod
    def get_agrs_buffer_size_hint(*args: Any, **kwargs: Any) -> NoReturn:
        """Not implemented (all-gather sessions): raises NotImplementedError."""
        _missing("get_agrs_buffer_size_hint", "all-gather/reduce-scatter")
