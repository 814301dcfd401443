// Whether another process of this host is still there, for the transports that share memory with it.
#pragma once

#include <string>

namespace portep {

// False once the process is gone: it does not exist, or it was killed and is a zombie its parent has not reaped.
// True for pid <= 0 (not known yet: nothing to tell).
bool process_alive(int pid);
// "rank 3 (pid 1234, alive)" or "... process gone)", for error messages; "rank 3 (unknown)" for pid <= 0.
std::string describe_rank_process(int rank, int pid);

}  // namespace portep
