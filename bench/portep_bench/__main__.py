"""`python -m portep.bench`: the benchmarks (implemented in the portep_bench package, installed alongside)."""

import argparse
import sys


def _best_mode():
    """The dispatch/combine benchmark on the best backend here: with two GPUs both modes across them, with one the
    normal-mode kernels with both ranks on it (loopback), else the host backend."""
    try:
        import torch

        from portep import native

        if native.build_info()["gpu_built"] and torch.cuda.is_available():
            return "gpu" if torch.cuda.device_count() >= 2 else "gpu-ht-loopback"
    except Exception:  # noqa: BLE001 - no torch CUDA, no native module: the host benchmark still runs
        pass
    return "ep"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m portep.bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode")
    ch = sub.add_parser("channel", help="command rate and write+signal latency through the proxies")
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
    if not argv:
        argv = [_best_mode()]
    elif argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "channel")
    ep = sub.add_parser("ep", help="layout, HT and LL dispatch/combine through portep.Buffer (host backend)")
    ep.add_argument("--ranks", type=int, default=4)
    ep.add_argument("--ranks-per-node", type=int, default=None, help="default: all ranks on one node")
    ep.add_argument("--transport", choices=["shm", "shm-unordered"], default="shm")
    ep.add_argument("--ht-tokens", type=int, default=4096)
    ep.add_argument("--ll-tokens", type=int, default=128)
    ep.add_argument("--hidden", type=int, default=7168)
    ep.add_argument("--topk", type=int, default=8)
    ep.add_argument("--ht-experts", type=int, default=256)
    ep.add_argument("--ll-experts", type=int, default=288)
    ep.add_argument("--iterations", type=int, default=3)
    sub.add_parser("gpu-fifo", help="GPU -> host command channel: commands/s and round trip (needs a GPU)")
    gl = sub.add_parser("gpu-ll", help="LL dispatch/combine on GPUs, direct and proxy paths, vs NCCL (needs 2 GPUs)")
    gl.add_argument("--tokens", type=int, default=128)
    gl.add_argument("--hidden", type=int, default=7168)
    gl.add_argument("--topk", type=int, default=8)
    gl.add_argument("--experts", type=int, default=288)
    gl.add_argument("--iterations", type=int, default=50)
    gl.add_argument("--proxy-transport", choices=["shm", "shm-unordered"], default="shm")
    gl.add_argument("--no-proxy", action="store_true", help="measure the direct NVLink path only")
    gh = sub.add_parser("gpu-ht", help="HT (normal) dispatch/combine on GPUs of one node vs NCCL (needs 2 GPUs)")
    gh.add_argument("--tokens", type=int, default=4096)
    gh.add_argument("--hidden", type=int, default=7168)
    gh.add_argument("--topk", type=int, default=8)
    gh.add_argument("--experts", type=int, default=256)
    gh.add_argument("--iterations", type=int, default=20)
    gh.add_argument("--sms", type=int, nargs="+", default=[24, 8, 16, 32], help="config.num_sms values to run")
    sub.add_parser("gpu", help="gpu-ll, then gpu-ht (the default with two GPUs)")
    lb = sub.add_parser("gpu-ht-loopback", help="HT kernels' own throughput, both EP2 ranks on one GPU (the default "
                        "with one GPU; peer stores go to that GPU's memory, not NVLink)")
    lb.add_argument("--sms", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64], help="config.num_sms per rank")
    lb.add_argument("--iterations", type=int, default=20)
    lb.add_argument("--masks", nargs="*", default=[], choices=["self", "peer", "none"],
                    help="also time BF16 dispatch with every token sent to its own rank only, the peer only, nowhere")
    lb.add_argument("--no-check", action="store_true", help="report outputs that differ instead of stopping")
    args = parser.parse_args(argv)
    if args.mode in ("gpu-ll", "gpu"):
        from portep_bench import ll_gpu

        if args.mode == "gpu":
            ll_gpu.run()
        else:
            ll_gpu.run(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                       iterations=args.iterations, proxy_transport=args.proxy_transport, with_proxy=not args.no_proxy)
        ll_gpu.run_channel()
    if args.mode in ("gpu-ht", "gpu"):
        from portep_bench import ht_gpu

        if args.mode == "gpu":
            ht_gpu.run()
        else:
            ht_gpu.run(tokens=args.tokens, hidden=args.hidden, topk=args.topk, experts=args.experts,
                       iterations=args.iterations, sms_list=tuple(args.sms))
    if args.mode == "gpu-ht-loopback":
        from portep_bench import ht_loopback

        ht_loopback.run(sms_list=tuple(args.sms), iterations=args.iterations, masks=tuple(args.masks),
                        check=not args.no_check)
    if args.mode == "gpu-fifo":
        from portep_bench import gpu_fifo

        gpu_fifo.run()
    if args.mode == "ep":
        from portep_bench import ep as ep_bench

        ep_bench.run(ranks=args.ranks, ranks_per_node=args.ranks_per_node, transport=args.transport,
                     ht_tokens=args.ht_tokens, ll_tokens=args.ll_tokens, hidden=args.hidden, topk=args.topk,
                     ht_experts=args.ht_experts, ll_experts=args.ll_experts, iterations=args.iterations)
    if args.mode == "channel":
        from portep_bench import channel

        channel.run(ranks=args.ranks, transports=tuple(args.transport or ("shm", "shm-unordered")),
                    threads=args.proxy_threads, producers=args.producers, messages=args.messages,
                    msg_bytes=args.message_bytes, signal_every=args.signal_every, sizes=tuple(args.sizes),
                    iterations=args.iterations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
