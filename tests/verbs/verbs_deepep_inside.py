"""Runs inside the soft-RoCE guest: the host-backend DeepEP bodies of deepep_workers (HT and LL, checked against
deepep_reference) over the verbs transports. HT runs with one rank per node: verbs cannot map a same-node peer's
memory, which normal mode's intranode path stores into (LL falls back to the proxies, so it runs with 2).
Arguments: scenario names (default: all). Prints one JSON line per scenario with its failures, check count and
seconds."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import deepep_workers as w
from dist_util import run_ranks

# name: (body, world, ranks per node, transport, extra args after transport)
SCENARIOS = {
    "ll/2x1/verbs": (w.ll_body, 2, 1, "verbs", (5, 32, 512, 8, 4, False, 1)),
    "ll/2x2/verbs-striped": (w.ll_body, 2, 2, "verbs-striped", (6, 32, 512, 8, 4, False, 1)),
    "ht/2x1/verbs": (w.ht_body, 2, 1, "verbs", (7, [96, 64], 512, 4, 8, 1)),
    # 2 ranks per node: node peers map each other's shared-memory regions (node views), other nodes via RDMA
    "ht/4x2/verbs-striped": (w.ht_body, 4, 2, "verbs-striped", (8, [64, 48, 80, 32], 512, 4, 16, 1)),
    "ht/4x2/verbs": (w.ht_body, 4, 2, "verbs", (10, [56, 72, 40, 64], 512, 4, 16, 1)),
    "ll/4x2/verbs": (w.ll_body, 4, 2, "verbs", (9, 16, 512, 8, 4, False, 1)),
}


def main():
    names = sys.argv[1:] or list(SCENARIOS)
    for name in names:
        body, world, rpn, transport, extra = SCENARIOS[name]
        start = time.monotonic()
        try:
            out = run_ranks(body, world, args=(rpn, transport) + extra, timeout=1500)
            failures = [f for r in sorted(out) for f in out[r]["failures"]]
            checks = [out[r]["checks"] for r in sorted(out)]
            result = {"name": name, "failures": failures[:20], "checks": checks}
        except Exception as exc:  # noqa: BLE001 - reported to the host-side test
            result = {"name": name, "exception": str(exc)[-4000:]}
        result["seconds"] = round(time.monotonic() - start, 1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
