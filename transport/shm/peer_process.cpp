#include "transport/shm/peer_process.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

namespace portep {

namespace {
// The state letter of a process from /proc/PID/stat ('?' when unreadable).
char process_state(int pid) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (!f) return '?';
  char buf[512];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  const char* close_paren = strrchr(buf, ')');  // the command name may hold spaces and parentheses
  return close_paren && close_paren[1] == ' ' ? close_paren[2] : '?';
}
}  // namespace

bool process_alive(int pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno != EPERM) return false;
  const char state = process_state(pid);  // a killed process stays a zombie until its parent reaps it: gone
  return state != 'Z' && state != 'X';
}

std::string describe_rank_process(int rank, int pid) {
  if (pid <= 0) return "rank " + std::to_string(rank) + " (unknown)";
  return "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
         (process_alive(pid) ? ", alive)" : ", process gone)");
}

}  // namespace portep
