// Whether another process of this host is still there, for the transports that share memory with it.
#pragma once

namespace portep {

// False once the process is gone: it does not exist, or it was killed and is a zombie its parent has not reaped.
bool process_alive(int pid);

}  // namespace portep
