"""An independent verbs peer for portep's RC transport, written with pyverbs (rdma-core's Python bindings; run
it with the system Python that has python3-pyverbs). It shares no code with portep: it opens the RDMA device,
creates its own RC QPs, and speaks portep's endpoint blob (transport/verbs/verbs_transport.cpp) and immediate
format (ordering/imm.h) from their descriptions. It plays rank 1 of a 2-rank group against a
portep rank 0 (tests/verbs/verbs_foreign_peer.py), talking JSON lines over stdin/stdout:

  in  {"blob", "channels", "qps_per_peer", "num_streams", "data_bytes", "gid_index", "plan_a", "atomic_stream"}
  out {"blob", "atomics"}      after its QPs are ready (receives posted)
  ... it RDMA-writes with immediate into portep's data region (plan_a), then fetch-and-adds into its signal slots
  out {"sent", "fetched"}
  in  {"expect", "native"}     what portep is about to write into this peer's data region
  out {"received"}             what arrived: bytes checked, lengths and immediates decoded
"""

import json
import socket
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GID, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

FINAL_MARK = 1 << 32
RECVS = 256
TIMEOUT = 60.0


def pattern(seed, n):
    import random

    return random.Random(seed).randbytes(n)


def stream_write_imm(stream, epoch):
    return (0 << 30) | ((epoch & 15) << 26) | ((stream & 0x1FFF) << 13)


def stream_signal_imm(stream, epoch, units, final):
    return (1 << 30) | (int(final) << 29) | ((epoch & 15) << 25) | ((stream & 0x1FFF) << 12) | (units & 0xFFF)


def decode_imm(v):
    kind = v >> 30
    if kind == 0:
        return {"kind": "write", "epoch": (v >> 26) & 15, "stream": (v >> 13) & 0x1FFF, "reserved": v & 0x1FFF}
    if kind == 1:
        return {
            "kind": "signal",
            "final": bool((v >> 29) & 1),
            "epoch": (v >> 25) & 15,
            "stream": (v >> 12) & 0x1FFF,
            "units": v & 0xFFF,
        }
    return {"kind": ["write", "signal", "seq_add", "control"][kind], "raw": v}


def no_sge(wr):
    """wr without scatter-gather elements (pyverbs constructs none without one): an immediate-only message."""
    wr.num_sge = 0
    return wr


def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Peer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.channels, self.q = cfg["channels"], cfg["qps_per_peer"]
        self.streams = cfg["num_streams"]
        names = [d.name.decode() for d in get_device_list()]
        if not names:
            raise RuntimeError("pyverbs: no RDMA device")
        self.ctx = Context(name=names[0])
        self.port = 1
        self.port_attr = self.ctx.query_port(self.port)
        self.atomics = self.ctx.query_device().atomic_caps != e.IBV_ATOMIC_NONE
        self.gid_index = cfg["gid_index"]
        self.gid = self.ctx.query_gid(self.port, self.gid_index)
        self.pd = PD(self.ctx)
        remote = (
            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC
        )
        self.data = MR(self.pd, cfg["data_bytes"], remote)
        self.signals = MR(self.pd, 2 * self.streams * 8, remote)
        self.data.write(bytes(cfg["data_bytes"]), cfg["data_bytes"], 0)
        self.signals.write(bytes(2 * self.streams * 8), 2 * self.streams * 8, 0)
        self.scratch = MR(self.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
        self.cq = CQ(self.ctx, 4096)
        self.qps = []  # [channel * q + stripe]
        for _ in range(self.channels * self.q):
            init = QPInitAttr(
                qp_type=e.IBV_QPT_RC,
                scq=self.cq,
                rcq=self.cq,
                cap=QPCap(max_send_wr=128, max_recv_wr=RECVS, max_send_sge=1, max_recv_sge=1),
            )
            self.qps.append(QP(self.pd, init))
        self.by_qpn = {qp.qp_num: i for i, qp in enumerate(self.qps)}

    def blob(self):
        """This peer as rank 1 in portep's blob format: lid, gid, data and signal "addr rkey bytes", host identity,
        segment names ("-": not mappable), then QP numbers for (channel, peer, stripe)."""
        lines = [str(self.port_attr.lid), self.gid.gid.replace(":", "")]
        for mr in (self.data, self.signals):
            lines.append(f"{mr.buf} {mr.rkey} {mr.length}")
        lines += ["pyverbs-peer", "- -"]
        for c in range(self.channels):
            for p in range(2):
                for s in range(self.q):
                    lines.append(str(self.qps[c * self.q + s].qp_num if p == 0 else 0))
        return "\n".join(lines) + "\n"

    def connect(self, blob):
        f = blob.split("\n")
        lid, gid_hex = int(f[0]), f[1]
        self.remote = [tuple(int(x) for x in f[2 + r].split()) for r in range(2)]  # (addr, rkey, bytes)
        dgid = GID(":".join(gid_hex[i : i + 4] for i in range(0, 32, 4)))
        for c in range(self.channels):
            for s in range(self.q):
                qp = self.qps[c * self.q + s]
                remote_qpn = int(f[6 + (c * 2 + 1) * self.q + s])  # portep's QP for (c, peer 1, s)
                a = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=self.port)
                a.pkey_index = 0
                a.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC
                qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)
                for _ in range(RECVS):
                    qp.post_recv(no_sge(RecvWR(num_sge=1, sg=[SGE(0, 0, 0)])))
                a = QPAttr(qp_state=e.IBV_QPS_RTR, path_mtu=self.port_attr.active_mtu)
                a.dest_qp_num, a.rq_psn, a.max_dest_rd_atomic, a.min_rnr_timer = remote_qpn, 0, 1, 12
                gr = GlobalRoute(dgid=dgid, sgid_index=self.gid_index, hop_limit=64)
                a.ah_attr = AHAttr(dlid=lid, is_global=1, port_num=self.port, gr=gr)
                qp.modify(
                    a,
                    e.IBV_QP_STATE
                    | e.IBV_QP_AV
                    | e.IBV_QP_PATH_MTU
                    | e.IBV_QP_DEST_QPN
                    | e.IBV_QP_RQ_PSN
                    | e.IBV_QP_MAX_DEST_RD_ATOMIC
                    | e.IBV_QP_MIN_RNR_TIMER,
                )
                a = QPAttr(qp_state=e.IBV_QPS_RTS)
                a.timeout, a.retry_cnt, a.rnr_retry, a.sq_psn, a.max_rd_atomic = 14, 7, 7, 0, 1
                qp.modify(
                    a,
                    e.IBV_QP_STATE
                    | e.IBV_QP_TIMEOUT
                    | e.IBV_QP_RETRY_CNT
                    | e.IBV_QP_RNR_RETRY
                    | e.IBV_QP_SQ_PSN
                    | e.IBV_QP_MAX_QP_RD_ATOMIC,
                )

    def qp_for(self, stream):
        return self.qps[(stream % self.channels) * self.q]  # stripe 0 of the stream's channel

    def wait_sends(self, n, what):
        done, deadline = 0, time.monotonic() + TIMEOUT
        while done < n:
            got, wcs = self.cq.poll(16)
            for wc in wcs[:got]:
                if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                    raise RuntimeError(f"unexpected receive while waiting for {what}")
                if wc.status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"{what} failed: status {wc.status} (vendor error {wc.vendor_err})")
                done += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {done} of {n} completions within {TIMEOUT} s")

    def write_imm(self, stream, off, size, imm):
        wr = SendWR(
            opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
            num_sge=1,
            sg=[SGE(self.data.buf + off, size, self.data.lkey)],
            imm_data=socket.htonl(imm),
            send_flags=e.IBV_SEND_SIGNALED,
        )
        if not size:
            no_sge(wr)
        wr.set_wr_rdma(self.remote[0][1], self.remote[0][0] + off)
        self.qp_for(stream).post_send(wr)
        self.wait_sends(1, "RDMA write with immediate")

    def phase_a(self):
        """plan_a: [stream, epoch, offset, size, final-signal-after (None: no signal)] in posting order."""
        units = {}
        for stream, epoch, off, size, signal in self.cfg["plan_a"]:
            if size:
                self.data.write(pattern(off, size), size, off)
                self.write_imm(stream, off, size, stream_write_imm(stream, epoch))
                units[(stream, epoch)] = units.get((stream, epoch), 0) + 1
            if signal is not None:
                self.write_imm(stream, 0, 0, stream_signal_imm(stream, epoch, units.get((stream, epoch), 0), signal))

    def phase_c(self):
        """Fetch-and-add into portep's slot (src 1, atomic_stream): 7, then 2 + the final mark; returns the old
        values it fetched."""
        if not self.atomics:
            return None
        stream = self.cfg["atomic_stream"]
        target = self.remote[1][0] + (1 * self.streams + stream) * 8
        fetched = []
        for value in (7, 2 + FINAL_MARK):
            wr = SendWR(
                opcode=e.IBV_WR_ATOMIC_FETCH_AND_ADD,
                num_sge=1,
                sg=[SGE(self.scratch.buf, 8, self.scratch.lkey)],
                send_flags=e.IBV_SEND_SIGNALED,
            )
            wr.set_wr_atomic(self.remote[1][1], target, value, 0)
            self.qp_for(stream).post_send(wr)
            self.wait_sends(1, "fetch-and-add")
            fetched.append(int.from_bytes(self.scratch.read(8, 0), "little"))
        return fetched

    def phase_b(self, expect, native):
        """expect: {stream: [[offset, size], ...]} (each stream's writes, then one final signal). native: portep
        signals with fetch-and-add into this peer's slots; else every write and signal carries an immediate."""
        expect = {int(k): v for k, v in expect.items()}
        writes, signals, lengths, problems = {}, {}, {}, []
        deadline = time.monotonic() + TIMEOUT
        if native:
            for stream, items in expect.items():
                want = len(items) + FINAL_MARK
                while int.from_bytes(self.signals.read(8, stream * 8), "little") != want:
                    if time.monotonic() > deadline:
                        problems.append(
                            f"stream {stream}: slot "
                            f"{int.from_bytes(self.signals.read(8, stream * 8), 'little'):#x} != {want:#x}"
                        )
                        break
                    time.sleep(0.001)
        while not native and any(not signals.get(s) or not signals[s][-1]["final"] for s in expect):
            if time.monotonic() > deadline:
                problems.append(f"timed out: signals {signals}")
                break
            got, wcs = self.cq.poll(16)
            for wc in wcs[:got]:
                if wc.status != e.IBV_WC_SUCCESS or wc.opcode != e.IBV_WC_RECV_RDMA_WITH_IMM:
                    problems.append(f"receive completion: status {wc.status}, opcode {wc.opcode}")
                    continue
                self.qps[self.by_qpn[wc.qp_num]].post_recv(no_sge(RecvWR(num_sge=1, sg=[SGE(0, 0, 0)])))
                d = decode_imm(socket.ntohl(wc.imm_data))
                key = (d.get("stream"), d.get("epoch"))
                if d["kind"] == "write":
                    writes[key] = writes.get(key, 0) + 1
                    lengths.setdefault(d["stream"], []).append(wc.byte_len)
                    if d["reserved"]:
                        problems.append(f"STREAM_WRITE with reserved bits {d}")
                elif d["kind"] == "signal":
                    signals.setdefault(d["stream"], []).append(d)
                else:
                    problems.append(f"unexpected immediate {d}")
        if not native:
            for stream, items in expect.items():
                got = signals.get(stream, [])
                if len(got) != 1 or got[0]["epoch"] != 0 or got[0]["units"] != len(items):
                    problems.append(f"stream {stream}: signals {got}, expected one final of {len(items)} units")
                if writes.get((stream, 0), 0) != len(items):
                    problems.append(
                        f"stream {stream}: {writes.get((stream, 0), 0)} write immediates, expected {len(items)}"
                    )
                if sorted(lengths.get(stream, [])) != sorted(size for _, size in items):
                    problems.append(f"stream {stream}: lengths {sorted(lengths.get(stream, []))}")
        for stream, items in expect.items():
            for off, size in items:
                if self.data.read(size, off) != pattern(100000 + off, size):
                    problems.append(f"stream {stream}: bytes at {off} (+{size}) differ from the pattern")
        return {
            "problems": problems,
            "writes_seen": sum(writes.values()),
            "signals_seen": sum(len(v) for v in signals.values()),
        }


def main():
    cfg = json.loads(sys.stdin.readline())
    peer = Peer(cfg)
    peer.connect(cfg["blob"])
    send({"blob": peer.blob(), "atomics": peer.atomics})
    json.loads(sys.stdin.readline())  # portep has connected
    peer.phase_a()
    fetched = peer.phase_c()
    send({"sent": True, "fetched": fetched})
    msg = json.loads(sys.stdin.readline())
    send({"received": peer.phase_b(msg["expect"], msg["native"])})
    json.loads(sys.stdin.readline())  # portep is done with this peer's QPs


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001 - reported to the portep side
        import traceback

        send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        sys.exit(1)
