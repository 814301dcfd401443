"""Pure ordering logic: PendingSignalTable, InflightTracker."""

import random

import pytest

from portep_testing import ordering

NUM_EPOCHS = 16
SEQ_SPACE = 256


# ---------------------------------------------------------------- PendingSignalTable


def make_signal_plans(rng, num_sources, num_streams):
    """{(src, stream): [(units, final), ...]} in epoch order, for a random subset of the table."""
    keys = [(s, t) for s in range(num_sources) for t in range(num_streams)]
    plans = {}
    for key in rng.sample(keys, rng.randint(1, len(keys))):
        n = rng.randint(17, 48) if rng.random() < 0.35 else rng.randint(1, 6)
        plans[key] = [(rng.randint(0, 20), rng.random() < 0.1) for _ in range(n - 1)]
        plans[key].append((rng.randint(0, 20), True))
    return plans


def signal_deliveries(rng, plans, window, policy):
    """Deliveries (key, epoch, "w"|"s") in a random order a sender with an epoch window can produce.

    The sender opens epoch e only once every event of epochs <= e - window has been delivered (in-order
    retirement of the signal that closed epoch e - window), so at most `window` epochs per stream are in
    flight. Within that, deliveries are arbitrary.
    """
    opened = dict.fromkeys(plans, 0)
    done_prefix = dict.fromkeys(plans, 0)
    remaining = {k: [] for k in plans}
    p_open = rng.choice([0.1, 0.5, 0.9])
    pool = []
    while True:
        openable = [k for k in plans if opened[k] < len(plans[k]) and opened[k] < done_prefix[k] + window]
        if not pool and not openable:
            return
        if openable and (not pool or rng.random() < p_open):
            key = rng.choice(openable)
            e = opened[key]
            opened[key] += 1
            units = plans[key][e][0]
            remaining[key].append(units + 1)
            pool.extend([(key, e, "w")] * units + [(key, e, "s")])
            continue
        i = len(pool) - 1 if policy == "newest_first" else rng.randrange(len(pool))
        pool[i], pool[-1] = pool[-1], pool[i]
        key, e, kind = pool.pop()
        yield key, e, kind
        remaining[key][e] -= 1
        while done_prefix[key] < opened[key] and remaining[key][done_prefix[key]] == 0:
            done_prefix[key] += 1


class SignalModel:
    """Absolute-epoch reference: release epoch e once its signal and all its writes are in and e-1 is released."""

    def __init__(self, plans):
        self.plans = plans
        self.arrived = {k: [0] * len(p) for k, p in plans.items()}
        self.signalled = {k: [False] * len(p) for k, p in plans.items()}
        self.next_release = dict.fromkeys(plans, 0)
        self.held = 0

    def write(self, key, e):
        self.arrived[key][e] += 1
        assert self.arrived[key][e] <= self.plans[key][e][0]
        return self._release(key)

    def signal(self, key, e):
        assert not self.signalled[key][e]
        self.signalled[key][e] = True
        self.held += 1
        return self._release(key)

    def _release(self, key):
        out = []
        plan = self.plans[key]
        while self.next_release[key] < len(plan):
            e = self.next_release[key]
            units, final = plan[e]
            if not (self.signalled[key][e] and self.arrived[key][e] == units):
                break
            assert all(self.signalled[key][:e]) and all(self.arrived[key][j] == plan[j][0] for j in range(e))
            out.append((key[0], key[1], units, final))
            self.next_release[key] += 1
            self.held -= 1
        return out


def run_signal_trial(rng, window, policy):
    num_sources, num_streams = rng.randint(1, 3), rng.randint(1, 4)
    plans = make_signal_plans(rng, num_sources, num_streams)
    table = ordering.PendingSignalTable(num_sources, num_streams)
    model = SignalModel(plans)
    per_stream = {k: [] for k in plans}
    for key, e, kind in signal_deliveries(rng, plans, window, policy):
        src, stream = key
        if kind == "w":
            got, want = table.on_write(src, stream, e % NUM_EPOCHS), model.write(key, e)
        else:
            units, final = plans[key][e]
            got, want = table.on_signal(src, stream, e % NUM_EPOCHS, units, final), model.signal(key, e)
        assert got == want, (key, e, kind)
        assert table.held == model.held
        for r in got:
            per_stream[(r[0], r[1])].append(r)
    for key, plan in plans.items():
        assert per_stream[key] == [(key[0], key[1], u, f) for u, f in plan]
    assert table.held == 0
    assert table.released == sum(len(p) for p in plans.values())
    return max(len(p) for p in plans.values())


@pytest.mark.parametrize("window", [15, 16])
@pytest.mark.parametrize("policy", ["random", "newest_first"])
@pytest.mark.parametrize("seed", range(5))
def test_pending_signals_match_model_over_random_interleavings(seed, policy, window):
    rng = random.Random(seed * 100 + window + (policy == "random"))
    longest = [run_signal_trial(rng, window, policy) for _ in range(100)]
    assert max(longest) > NUM_EPOCHS


def test_pending_signals_full_window_of_16_held_then_released_in_order():
    table = ordering.PendingSignalTable(1, 1)
    for base in (0, 16, 32):
        for e in range(base, base + 16):
            assert table.on_signal(0, 0, e % 16, 1, e == 47) == []
        assert table.held == 16
        for e in reversed(range(base + 1, base + 16)):
            assert table.on_write(0, 0, e % 16) == []
        released = table.on_write(0, 0, base % 16)
        assert released == [(0, 0, 1, e == 47) for e in range(base, base + 16)]
        assert table.held == 0
    assert table.released == 48


def test_pending_signal_with_zero_units_waits_for_earlier_epoch():
    table = ordering.PendingSignalTable(1, 1)
    assert table.on_signal(0, 0, 1, 0, True) == []
    assert table.on_signal(0, 0, 0, 2, False) == []
    assert table.on_write(0, 0, 0) == []
    assert table.on_write(0, 0, 0) == [(0, 0, 2, False), (0, 0, 0, True)]


def test_pending_duplicate_signal_raises():
    table = ordering.PendingSignalTable(2, 2)
    table.on_signal(1, 1, 3, 2, False)
    with pytest.raises(RuntimeError, match="duplicate signal"):
        table.on_signal(1, 1, 3, 2, False)


def test_pending_epoch_window_overrun_is_a_duplicate_signal():
    table = ordering.PendingSignalTable(1, 1)
    for e in range(16):
        table.on_signal(0, 0, e % 16, 1, False)
    with pytest.raises(RuntimeError, match="duplicate signal"):
        table.on_signal(0, 0, 16 % 16, 1, False)


def test_pending_more_writes_than_announced_after_signal_raises():
    table = ordering.PendingSignalTable(1, 1)
    table.on_signal(0, 0, 0, 2, False)
    table.on_signal(0, 0, 1, 2, False)
    table.on_write(0, 0, 1)
    table.on_write(0, 0, 1)
    with pytest.raises(RuntimeError, match=r"more writes arrived than its signal announced \(2\)"):
        table.on_write(0, 0, 1)


def test_pending_signal_announcing_fewer_writes_than_arrived_raises():
    table = ordering.PendingSignalTable(1, 1)
    for _ in range(3):
        table.on_write(0, 0, 5)
    with pytest.raises(RuntimeError, match="3 writes arrived but the signal announced 2"):
        table.on_signal(0, 0, 5, 2, True)


@pytest.mark.parametrize("src,stream", [(3, 0), (0, 5), (3, 5), (100, 1), (1, 4096)])
def test_pending_notification_outside_table_raises(src, stream):
    table = ordering.PendingSignalTable(3, 5)
    with pytest.raises(RuntimeError, match="outside the table"):
        table.on_write(src, stream, 0)
    with pytest.raises(RuntimeError, match="outside the table"):
        table.on_signal(src, stream, 0, 0, False)


@pytest.mark.parametrize("num_streams", [8193, 10000, 1 << 20])
def test_pending_table_refuses_more_streams_than_the_immediate_encodes(num_streams):
    with pytest.raises((ValueError, RuntimeError), match="8192"):
        ordering.PendingSignalTable(1, num_streams)


@pytest.mark.parametrize("units", [4096, 65537])
def test_pending_signal_units_beyond_the_encoding_are_refused(units):
    table = ordering.PendingSignalTable(1, 1)
    with pytest.raises(RuntimeError, match="4095"):
        table.on_signal(0, 0, 0, units, False)


def test_pending_signal_max_units_released_after_exactly_that_many_writes():
    table = ordering.PendingSignalTable(1, 1)
    assert table.on_signal(0, 0, 0, 4095, False) == []
    for _ in range(4094):
        assert table.on_write(0, 0, 0) == []
    assert table.on_write(0, 0, 0) == [(0, 0, 4095, False)]


def test_pending_table_accepts_exactly_8192_streams():
    table = ordering.PendingSignalTable(1, 8192)
    assert table.on_signal(0, 8191, 0, 0, True) == [(0, 8191, 0, True)]


# ---------------------------------------------------------------- InflightTracker


def test_inflight_random_completion_order_retires_in_order():
    rng = random.Random(42)
    for n in (1, 2, 17, 64, 200):
        tracker = ordering.InflightTracker(n, 1 << 40)
        for i in range(n):
            assert tracker.on_post(i + 1) == i
        done = [False] * n
        for seq in rng.sample(range(n), n):
            tracker.on_complete(seq)
            done[seq] = True
            first_open = done.index(False) if False in done else n
            assert tracker.retired == first_open
            assert tracker.inflight_bytes == sum(range(first_open + 1, n + 1))


@pytest.mark.parametrize("seed", range(6))
def test_inflight_tracker_matches_model_under_random_posts_and_completions(seed):
    rng = random.Random(seed)
    for _ in range(40):
        max_cmds, max_bytes = rng.randint(1, 20), rng.randint(1, 5000)
        tracker = ordering.InflightTracker(max_cmds, max_bytes)
        sizes, done, retired = [], [], 0
        p_post = rng.choice([0.3, 0.6, 0.9])
        for _ in range(rng.randint(50, 300)):
            size = rng.choice([0, rng.randint(1, max_bytes), rng.randint(max_bytes, 3 * max_bytes)])
            inflight = len(sizes) - retired
            room = inflight < max_cmds and (sum(sizes[retired:]) + size <= max_bytes or inflight == 0)
            assert tracker.has_room(size) == room
            open_seqs = [s for s in range(retired, len(sizes)) if not done[s]]
            if room and (rng.random() < p_post or not open_seqs):
                assert tracker.on_post(size) == len(sizes)
                sizes.append(size)
                done.append(False)
            elif open_seqs:
                seq = rng.choice(open_seqs)
                tracker.on_complete(seq)
                done[seq] = True
                while retired < len(sizes) and done[retired]:
                    retired += 1
            assert (tracker.posted, tracker.retired) == (len(sizes), retired)
            assert tracker.inflight_bytes == sum(sizes[retired:])
        for seq in rng.sample(range(retired, len(sizes)), len(sizes) - retired):
            if not done[seq]:
                tracker.on_complete(seq)
        assert tracker.retired == tracker.posted == len(sizes)
        assert tracker.inflight_bytes == 0


def test_inflight_command_cap_blocks_until_the_oldest_retires():
    tracker = ordering.InflightTracker(4, 1 << 30)
    for _ in range(4):
        tracker.on_post(10)
    assert not tracker.has_room(0)
    tracker.on_complete(3)
    tracker.on_complete(1)
    assert not tracker.has_room(0)
    tracker.on_complete(0)
    assert tracker.retired == 2
    assert tracker.has_room(10)


def test_inflight_byte_cap():
    tracker = ordering.InflightTracker(100, 1000)
    tracker.on_post(600)
    assert tracker.has_room(400)
    assert not tracker.has_room(401)
    tracker.on_post(400)
    assert not tracker.has_room(1)
    assert tracker.has_room(0)
    tracker.on_complete(0)
    assert tracker.inflight_bytes == 400
    assert tracker.has_room(600) and not tracker.has_room(601)


def test_inflight_oversize_post_allowed_only_when_idle():
    tracker = ordering.InflightTracker(8, 1000)
    assert tracker.has_room(5000)
    tracker.on_post(5000)
    assert not tracker.has_room(1)
    tracker.on_complete(0)
    tracker.on_post(1)
    assert not tracker.has_room(5000)
    assert tracker.has_room(999)
    tracker.on_complete(1)
    assert tracker.has_room(5000)


def test_inflight_duplicate_completion_raises():
    tracker = ordering.InflightTracker(4, 1000)
    tracker.on_post(1)
    tracker.on_post(1)
    tracker.on_complete(1)
    with pytest.raises(RuntimeError, match="duplicate completion"):
        tracker.on_complete(1)


def test_inflight_completion_of_retired_or_unposted_sequence_raises():
    tracker = ordering.InflightTracker(4, 1000)
    tracker.on_post(1)
    tracker.on_complete(0)
    with pytest.raises(RuntimeError, match="not in flight"):
        tracker.on_complete(0)
    with pytest.raises(RuntimeError, match="not in flight"):
        tracker.on_complete(1)


def test_inflight_zero_command_cap_rejected():
    with pytest.raises(ValueError):
        ordering.InflightTracker(0, 1000)
