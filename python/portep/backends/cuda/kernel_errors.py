"""What the CUDA kernels report (gpu_kernels/cuda/kernel_errors.h): failures, which leave a Buffer failed, and
notices, which the host raises once and then re-arms (the Buffer stays usable). One per CudaEngine: the device
words the kernels test and the mapped host records the host reads (a native MappedHost, which owns them)."""

import torch


class KernelErrors:
    def __init__(self, native, device):
        self.native = native
        self.info = {e["code"]: e for e in native.KERNEL_ERRORS}
        words, record = native.KERNEL_ERROR_WORDS, native.KERNEL_ERROR_BYTES // 4
        self.records = native.MappedHost(words * record * 4)  # [words] records, the code first in each
        self._record = record
        self.words = torch.zeros(words, dtype=torch.int32, device=device)  # device: [0] failures, [1] notices

    def name(self, code):
        return self.info[code]["name"] if code in self.info else None

    def record(self, word):
        """(code, rank, src, index, value) of record `word` (0: failures, 1: notices); code 0: none. Read natively:
        the code first (acquire), then the fields a kernel wrote before publishing it."""
        return tuple(self.native.kernel_error_record(self.records, word))

    def message(self, code, rank, src, index, value, suffix=""):
        """'rank R: a kernel failed: what (where)suffix' (a notice: 'a kernel reported: ...')."""
        e = self.info.get(code)
        if e is None:
            return f"rank {rank}: a kernel reported unknown code {code} (src {src}, index {index}){suffix}"
        where = e["where"].replace("{src}", str(src)).replace("{index}", str(index)).replace("{value}", str(value))
        where = where.replace("{status}", self.native.peer_status_text(index))
        kind = "reported" if e["notice"] else "failed"
        return f"rank {rank}: a kernel {kind}: {e['what']} ({where}){suffix}"

    def take_notice(self):
        """The pending notice as (code, message), re-armed for the next one (None when there is none; also while
        the current stream is being captured into a CUDA graph, which would record the re-arming instead of running
        it: the notice then waits for the next call outside the capture). The host record is cleared before the
        device word, so a notice reported in between is lost rather than never re-armed."""
        record = self.record(1)
        if not record[0] or torch.cuda.is_current_stream_capturing():
            return None
        self.records.store_u32(self._record, 0)  # the notice record's code
        self.words[1:].zero_()
        return record[0], self.message(*record)

    def clear(self):
        """Both words and records back to zero (the ranks resynchronise; no kernel of the Buffer runs)."""
        self.records.zero()
        self.words.zero_()

    def free(self):
        self.records.close()
