"""portep's side of the pyverbs peer scenario (tests/verbs/verbs_pyverbs_peer.py; run inside the soft-RoCE guest from
tests/verbs/verbs_inside.py): a portep rank 0 in a 2-rank group whose rank 1 is the pyverbs process. It checks that
(a) the peer's writes with immediate land and become portep signals per the immediate format, (c) the peer's
fetch-and-adds into portep's signal slots are what wait_signal sees, and (b) portep's writes (and signals) arrive
at the peer with the bytes, lengths and immediates that were asked for."""

import json
import os
import random
import re
import select
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
PYVERBS_PYTHON = os.environ.get("PORTEP_PYVERBS_PYTHON", "/usr/bin/python3")
FINAL = 1 << 32
STREAMS, CHANNELS, DATA = 8, 2, 1 << 18


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def pyverbs_missing():
    """Why the peer cannot run here, or None."""
    if not os.path.exists(PYVERBS_PYTHON):
        return f"{PYVERBS_PYTHON} does not exist (set PORTEP_PYVERBS_PYTHON)"
    r = subprocess.run([PYVERBS_PYTHON, "-c", "import pyverbs.qp, pyverbs.enums"], capture_output=True, text=True)
    if r.returncode:
        return f"pyverbs is not importable by {PYVERBS_PYTHON} (install python3-pyverbs): {r.stderr.strip()[-300:]}"
    return None


class PeerProcess:
    def __init__(self):
        self.p = subprocess.Popen(
            [PYVERBS_PYTHON, os.path.join(HERE, "verbs_pyverbs_peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout=120.0):
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if ready else ""
        if not line:
            self.p.kill()
            raise RuntimeError(
                f"the pyverbs peer said nothing within {timeout} s (exit {self.p.poll()}): "
                f"{self.p.stderr.read()[-2000:]}"
            )
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"pyverbs peer: {msg['error']}\n{msg.get('traceback', '')}")
        return msg

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(10)
        except Exception:  # noqa: BLE001 - best effort
            self.p.kill()


def pyverbs_peer(_C, rank, world, transport, shared, barrier):
    missing = pyverbs_missing()
    if missing:
        return {"skipped": missing}
    ch = _C.Channel(
        rank=0,
        num_ranks=2,
        nbytes=DATA,
        transport=transport,
        num_proxy_threads=CHANNELS,
        num_fifos=4,
        fifo_capacity=1024,
        num_streams=STREAMS,
        max_inflight_cmds=64,
        max_inflight_bytes=1 << 22,
        timeout_s=30.0,
        unordered_window=64,
        seed=0,
        skip_ordering=False,
    )
    qps = int(os.environ.get("PORTEP_IB_QPS_PER_PEER", "4" if transport == "verbs-striped" else "1"))
    gid = re.search(r"GID index (\d+)", ch.describe_peer(1))
    # (stream, epoch, offset, size, signal after it: None, False (not final) or True (final)), in posting order
    plan_a = [
        (0, 0, 0, 4096, None),
        (0, 0, 4096, 100, None),
        (0, 0, 8192, 3000, False),
        (0, 1, 12288, 65536, None),
        (0, 1, 80000, 16, True),
        (1, 0, 90000, 2048, None),
        (1, 0, 100000, 7, None),
        (1, 0, 110000, 1, None),
        (1, 0, 120000, 512, True),
    ]
    peer = PeerProcess()
    try:
        peer.send(
            {
                "blob": ch.endpoint_blob().decode("latin-1"),
                "channels": CHANNELS,
                "qps_per_peer": qps,
                "num_streams": STREAMS,
                "data_bytes": DATA,
                "gid_index": int(gid.group(1)) if gid else 0,
                "plan_a": plan_a,
                "atomic_stream": 2,
            }
        )
        hello = peer.recv()
        ch.connect([ch.endpoint_blob(), hello["blob"].encode("latin-1")])
        ch.bootstrap_done()
        peer.send({"connected": True})
        sent = peer.recv()
        mem = memoryview(ch.data_view())
        # (a) signals from the peer's immediates: stream 0 had epochs of 3 and 2 writes, stream 1 one of 4
        slots = {s: ch.wait_signal(1, s, n, 30.0) for s, n in ((0, 5), (1, 4))}
        bad_a = [off for _, _, off, size, _ in plan_a if bytes(mem[off : off + size]) != pattern(off, size)]
        # (c) the peer's fetch-and-adds of 7, then 2 + the final mark, into slot (src 1, stream 2)
        atomic_slot = ch.wait_signal(1, 2, 9, 30.0) if hello["atomics"] else None
        # (b) portep writes into the peer: streams 3 and 4, mixed sizes, each closed by a final signal
        expect = {3: [(0, 4096), (8192, 1), (16384, 20000)], 4: [(65536, 100), (80000, 40000)]}
        for stream, items in expect.items():
            for off, size in items:
                mem[DATA // 2 + off : DATA // 2 + off + size] = pattern(100000 + off, size)
        peer.send({"expect": expect, "native": ch.native_signals})
        for stream, items in expect.items():
            for off, size in items:
                ch.write(1, DATA // 2 + off, off, size, stream)
            ch.signal(1, stream, True)
        ch.quiet()
        received = peer.recv()["received"]
        peer.send({"done": True})
        result = {
            "slots": slots,
            "bad_offsets_a": bad_a,
            "atomic_slot": atomic_slot,
            "fetched": sent["fetched"],
            "received": received,
            "native_signals": ch.native_signals,
            "describe": ch.describe_peer(1),
        }
        ch.destroy()
        return result
    finally:
        peer.close()
