"""The process's record of the GPU regions it exported (transport/own_regions.h), through which a rank that is a
thread of the same process opens a peer's region by address (CUDA and HIP IPC refuse a handle of the calling
process): a handle is found only while its region is recorded, a region's every handle goes with it, a handle
exported again names the newer region, concurrent threads see a consistent record, and a DeviceMemory's openings
by address are given back one by one (never closed as IPC mappings)."""

import threading

from portep_testing import own_regions as own


def test_found_while_recorded_and_forgotten_with_its_region():
    a, b = b"handle-a" + bytes(56), b"handle-b" + bytes(56)
    own.add(a, 0x7F0000001000, 0)
    own.add(b, 0x7F0000002000, 1)
    own.add(b"second-a" + bytes(56), 0x7F0000001000, 0)  # the same region exported twice
    assert own.find(a) == (0x7F0000001000, 0) and own.find(b) == (0x7F0000002000, 1)
    assert own.find(b"handle-c" + bytes(56)) == (0, -1)  # another process's handle: not ours
    own.remove(0x7F0000001000)
    assert own.find(a) == (0, -1) and own.find(b"second-a" + bytes(56)) == (0, -1)
    assert own.find(b) == (0x7F0000002000, 1)
    own.add(b, 0x7F0000003000, 2)  # the handle now names a newer region
    assert own.find(b) == (0x7F0000003000, 2)
    own.remove(0x7F0000003000)
    assert own.find(b) == (0, -1)


def test_threads_record_and_find_their_own_regions():
    errors = []

    def worker(t):
        for i in range(300):
            h = f"t{t}-{i}".encode().ljust(64, b"\0")
            address = 0x100000 * (t + 1) + i * 0x1000
            own.add(h, address, t)
            if own.find(h) != (address, t):
                errors.append((t, i, own.find(h)))
            own.remove(address)
            if own.find(h) != (0, -1):
                errors.append((t, i, "still found"))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and not any(th.is_alive() for th in threads), errors[:3]


def test_a_region_opened_by_address_is_given_back_once_per_opening():
    opened = own.Opened()
    opened.add(0x5000)
    opened.add(0x5000)  # two channels of one rank opened the same peer region
    assert opened.release(0x6000) is False  # an IPC mapping: the caller closes it
    assert opened.release(0x5000) is True and opened.release(0x5000) is True
    assert opened.release(0x5000) is False  # every opening given back
