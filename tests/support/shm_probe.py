"""Where portep's shared memory shows from outside (transport/shm/shm_segment.h): names in /dev/shm (portep never
makes one), memfds a process holds open for its peers (only while a Channel is being built), and the segments this
process maps (only while a Channel lives)."""

import os


def named_segments(pid):
    """Names in /dev/shm that carry pid's portep prefix."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"portep.{pid}."))


def shared_memfds(pid):
    """The portep memfds pid holds open (names as /proc shows them); [] for a process that is gone."""
    fd_dir = f"/proc/{pid}/fd"
    names = []
    try:
        fds = os.listdir(fd_dir)
    except FileNotFoundError:
        return names
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("/memfd:portep."):
            names.append(target)
    return sorted(names)


def mapped_segments():
    """The portep segments this process maps (names as /proc/self/maps shows them)."""
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if "/memfd:portep." in line}
