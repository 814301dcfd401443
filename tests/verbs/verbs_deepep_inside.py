"""Runs inside the soft-RoCE guest: the host-backend DeepEP bodies of deepep_workers (HT and LL, checked against
deepep_reference) over the verbs transports. HT runs with one rank per node: verbs cannot map a same-node peer's
memory, which normal mode's intranode path stores into (LL falls back to the proxies, so it runs with 2).
The scenarios of one world size run one after another in the same rank processes: under the guest's emulated CPU
each process takes about a minute to import torch, more than most scenarios take.
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
    # 2 ranks per node: node peers map each other's shared-memory regions (node views), other nodes via RDMA (HT over
    # RC verbs, with its native atomics, runs in ht/2x1/verbs)
    "ht/4x2/verbs-striped": (w.ht_body, 4, 2, "verbs-striped", (8, [64, 48, 80, 32], 512, 4, 16, 1)),
    "ll/4x2/verbs": (w.ll_body, 4, 2, "verbs", (9, 16, 512, 8, 4, False, 1)),
}


def scenarios_body(rank, world, names):
    """One rank of each named scenario, in order: {name: {failures, checks, seconds}}."""
    results = {}
    for name in names:
        body, _, rpn, transport, extra = SCENARIOS[name]
        start = time.monotonic()
        out = body(rank, world, rpn, transport, *extra)
        results[name] = {"failures": out["failures"], "checks": out["checks"], "seconds": time.monotonic() - start}
    return results


def main():
    names = sys.argv[1:] or list(SCENARIOS)
    for world in sorted({SCENARIOS[name][1] for name in names}):
        group = [name for name in names if SCENARIOS[name][1] == world]
        start = time.monotonic()
        try:
            out = run_ranks(scenarios_body, world, args=(group,), timeout=1500)
            ranks = sorted(out)
            results = [
                {
                    "name": name,
                    "failures": [f for r in ranks for f in out[r][name]["failures"]][:20],
                    "checks": [out[r][name]["checks"] for r in ranks],
                    "seconds": round(max(out[r][name]["seconds"] for r in ranks), 1),
                }
                for name in group
            ]
        except Exception as exc:  # noqa: BLE001 - reported to the host-side test, for every scenario of the group
            results = [{"name": name, "exception": str(exc)[-4000:]} for name in group]
        print(f"world {world}: {time.monotonic() - start:.0f} s with its ranks' start", flush=True)
        for result in results:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
