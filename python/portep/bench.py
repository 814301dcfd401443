"""`python -m portep.bench`: the benchmarks (implemented in the portep_bench package, installed alongside)."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m portep.bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode")
    ch = sub.add_parser("channel", help="command rate and write+signal latency through the proxies (default)")
    ch.add_argument("--ranks", type=int, default=4, help="local ranks (processes), default 4")
    ch.add_argument("--transport", action="append", choices=["shm", "shm-unordered"],
                    help="repeat to run several; default both")
    ch.add_argument("--proxy-threads", type=int, default=4)
    ch.add_argument("--producers", type=int, default=4, help="host producer threads per rank")
    ch.add_argument("--messages", type=int, default=20000, help="writes per producer")
    ch.add_argument("--message-bytes", type=int, default=64)
    ch.add_argument("--signal-every", type=int, default=8)
    ch.add_argument("--iterations", type=int, default=2000, help="round trips per latency size")
    ch.add_argument("--sizes", type=int, nargs="+", default=[8, 4096], help="latency payload sizes in bytes")
    argv = list(argv if argv is not None else sys.argv[1:])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "channel")
    args = parser.parse_args(argv)
    if args.mode == "channel":
        from portep_bench import channel

        channel.run(ranks=args.ranks, transports=tuple(args.transport or ("shm", "shm-unordered")),
                    threads=args.proxy_threads, producers=args.producers, messages=args.messages,
                    msg_bytes=args.message_bytes, signal_every=args.signal_every, sizes=tuple(args.sizes),
                    iterations=args.iterations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
