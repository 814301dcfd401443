"""python -m portep_bench [MODE] [options]: portep's benchmarks, each table with min / median / mean / max of its
samples and the baseline measured in the same run. Without a MODE (options alone included) it runs the best one for
this machine: gpu with two GPUs, gpu-ht-loopback, gpu-ht-nodes, gpu-ep and ll-host with one, else ep (the host
backend). --json PATH saves every table with its raw samples; --plot DIR draws one PNG per table (needs
matplotlib)."""

import argparse
import shlex
import sys

from portep_bench import plot
from portep_bench.report import MissingHardware, Progress, Report, Table

FORMATTER = argparse.ArgumentDefaultsHelpFormatter


# Modes whose ranks are threads of this process on one GPU, their kernels waiting for each other across the ranks'
# streams: CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default) in turn and runs each
# queue in order, so two ranks' streams on one queue can hold a kernel behind the peer kernel it waits for (suspected,
# not proven, in the 3-node gpu-ht-nodes stalls on an H100 with two streams a rank; it ends with one stream a rank, at 8
# queues too). CUDA reads the variable when it sets up the GPU, hence before any mode runs.
ONE_PROCESS_RANKS = ("gpu-ht-loopback", "gpu-ht-nodes")


def widen_hardware_queues(modes):
    """Ask CUDA for the most hardware queues (portep.config's widening, as with proxy copies) where a mode runs ranks
    as threads, unless the caller chose a number or CUDA is already set up."""
    if any(m in ONE_PROCESS_RANKS for m in modes):
        from portep import config

        config.widen_cuda_connections()


def default_modes():
    """The dispatch/combine benchmarks on the best backend here: with two GPUs both modes across them, with one the
    normal-mode kernels with both ranks on it (loopback) and the LL calls' host time, else the host backend."""
    try:
        import torch

        from portep import native

        if native.build_info()["gpu_built"] and torch.cuda.is_available():
            if torch.cuda.device_count() >= 2:
                return ("gpu",)
            return ("gpu-ht-loopback", "gpu-ht-nodes", "gpu-ep", "ll-host")
    except Exception:  # noqa: BLE001 - no torch CUDA, no native module: the host benchmark still runs
        pass
    return ("ep",)


def _add_ep(sub, common):
    from portep_bench.ep import default_ranks

    p = sub.add_parser(
        "ep",
        parents=[common],
        formatter_class=FORMATTER,
        help="layout, HT and LL dispatch/combine through portep.Buffer on the host backend (a CPU "
        "emulation of the protocols, not GPU speed) vs gloo all_to_all_single",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=default_ranks(),
        help="rank processes; the default is this machine's core count, 2 to 4",
    )
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node; None: all ranks on one node")
    p.add_argument(
        "--transport", choices=["shm", "shm-unordered"], default="shm", help="host transport (portep.Buffer transport=)"
    )
    p.add_argument("--ht-tokens", type=int, default=4096, help="tokens per rank, HT (normal) mode")
    p.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank, LL (low-latency) mode")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (a multiple of 128)")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--ht-experts", type=int, default=256, help="experts, HT mode")
    p.add_argument("--ll-experts", type=int, default=288, help="experts, LL mode")
    p.add_argument("--iterations", type=int, default=10, help="timed calls per op")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per op before them")


def _add_channel(sub, common):
    p = sub.add_parser(
        "channel",
        parents=[common],
        formatter_class=FORMATTER,
        help="command rate and write+signal latency through the proxies (host backend)",
    )
    p.add_argument("--ranks", type=int, default=4, help="local ranks (processes)")
    p.add_argument(
        "--transport", action="append", choices=["shm", "shm-unordered"], help="repeat to run several; None: both"
    )
    p.add_argument("--proxy-threads", type=int, default=4, help="proxy threads per rank")
    p.add_argument("--producers", type=int, default=4, help="host producer threads per rank")
    p.add_argument("--messages", type=int, default=20000, help="writes per producer")
    p.add_argument("--message-bytes", type=int, default=64, help="largest write")
    p.add_argument("--signal-every", type=int, default=8, help="a signal after 1 in this many writes")
    p.add_argument("--iterations", type=int, default=2000, help="round trips per latency size")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4096], help="latency payload sizes in bytes")


def _add_gpu(sub, common):
    sub.add_parser(
        "gpu-fifo",
        parents=[common],
        formatter_class=FORMATTER,
        help="GPU -> host command channel: commands/s and round trip (needs a GPU)",
    )
    p = sub.add_parser(
        "gpu-ll",
        parents=[common],
        formatter_class=FORMATTER,
        help="LL dispatch/combine on GPUs, direct and proxy paths, vs NCCL (needs 2 GPUs)",
    )
    _shape_arguments(p, tokens=128, experts=288, iterations=50)
    p.add_argument(
        "--proxy-transport", choices=["shm", "shm-unordered"], default="shm", help="transport of the forced proxy path"
    )
    p.add_argument("--no-proxy", action="store_true", help="measure the direct NVLink path only")
    p = sub.add_parser(
        "gpu-ht",
        parents=[common],
        formatter_class=FORMATTER,
        help="HT (normal) dispatch/combine on GPUs of one node vs NCCL (needs 2 GPUs)",
    )
    _shape_arguments(p, tokens=4096, experts=256, iterations=20)
    p.add_argument("--sms", type=int, nargs="+", default=[24, 8, 16, 32], help="config.num_sms values to run")
    sub.add_parser(
        "gpu",
        parents=[common],
        formatter_class=FORMATTER,
        help="gpu-ll, then gpu-ht, with their defaults (the default with two GPUs)",
    )
    p = sub.add_parser(
        "gpu-ht-loopback",
        parents=[common],
        formatter_class=FORMATTER,
        help="HT kernels' own throughput, both EP2 ranks on one GPU (peer stores go to that GPU's "
        "memory, not NVLink; the default with one GPU, then ll-host)",
    )
    p.add_argument("--sms", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64], help="config.num_sms per rank")
    p.add_argument("--iterations", type=int, default=20, help="timed launches per op")
    p.add_argument(
        "--masks",
        nargs="*",
        default=[],
        choices=["self", "peer", "none"],
        help="also time BF16 dispatch with every token sent to its own rank only, the peer only, nowhere",
    )
    p.add_argument("--no-check", action="store_true", help="report outputs that differ instead of stopping")
    p = sub.add_parser(
        "gpu-ht-nodes",
        parents=[common],
        formatter_class=FORMATTER,
        help="normal mode across nodes on one GPU: 2 simulated nodes x 2 ranks as threads of one process, the "
        "proxies between the nodes (a default with one GPU)",
    )
    _shape_arguments(p, tokens=4096, experts=256, iterations=20)
    p.add_argument(
        "--sms", type=int, nargs="+", default=[20, 8], help="config.num_sms per rank (every rank's blocks must fit)"
    )
    p.add_argument(
        "--transport", choices=["shm", "shm-unordered"], default="shm", help="transport between the simulated nodes"
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=2,
        help="simulated nodes of 2 ranks each (3 and more: the forwarders serve several nodes; fewer SM counts fit)",
    )
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds any wait may take (the Buffers' and the benchmark's)"
    )
    p = sub.add_parser(
        "gpu-ep",
        parents=[common],
        formatter_class=FORMATTER,
        help="DeepEP V2's API (ElasticBuffer) next to V1's (Buffer) and a device copy, one rank on one GPU "
        "(a default with one GPU)",
    )
    _shape_arguments(p, tokens=4096, experts=256, iterations=20)
    p.add_argument("--sms", type=int, default=24, help="Buffer.num_sms for both APIs")
    p = sub.add_parser(
        "ll-host",
        parents=[common],
        formatter_class=FORMATTER,
        help="host (CPU) time of the LL dispatch/combine calls on one GPU, next to a baseline (needs a GPU)",
    )
    p.add_argument("--calls", type=int, default=1000, help="timed calls per row")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also print cProfile's report of N round trips through the full Python path",
    )


def _shape_arguments(p, tokens, experts, iterations):
    p.add_argument("--tokens", type=int, default=tokens, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (a multiple of 128)")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--experts", type=int, default=experts, help="experts in all")
    p.add_argument("--iterations", type=int, default=iterations, help="timed calls per op")


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", metavar="PATH", help="write every table, its raw samples and the machine's facts as JSON"
    )
    common.add_argument("--plot", metavar="DIR", help=f"write one PNG per table (needs matplotlib: {plot.HOW_TO_GET})")
    parser = argparse.ArgumentParser(
        prog="python -m portep_bench",
        description=__doc__,
        formatter_class=FORMATTER,
        epilog=f"default here: {' then '.join(default_modes())}; 'python -m portep_bench "
        "MODE --help' shows a mode's options and their defaults",
    )
    sub = parser.add_subparsers(dest="mode", metavar="MODE")
    _add_ep(sub, common)
    _add_channel(sub, common)
    _add_gpu(sub, common)
    return parser, sub.choices


def parse(argv):
    """One namespace per mode to run: the MODE given, else this machine's default modes, each taking the options
    it knows (an option no default mode knows is an error)."""
    parser, modes = build_parser()
    if argv and (argv[0] in ("-h", "--help") or not argv[0].startswith("-")):
        return [parser.parse_args(argv)]
    runs, unknown_to_all = [], None
    for mode in default_modes():
        args, unknown = modes[mode].parse_known_args(argv)
        args.mode = mode
        runs.append(args)
        unknown_to_all = unknown if unknown_to_all is None else [a for a in unknown_to_all if a in unknown]
    if unknown_to_all:
        parser.error(f"unrecognized arguments for {' then '.join(a.mode for a in runs)}: {' '.join(unknown_to_all)}")
    return runs


def run_ep(args, report):
    from portep_bench import ep

    ep.run(
        report,
        ranks=args.ranks,
        ranks_per_node=args.ranks_per_node,
        transport=args.transport,
        ht_tokens=args.ht_tokens,
        ll_tokens=args.ll_tokens,
        hidden=args.hidden,
        topk=args.topk,
        ht_experts=args.ht_experts,
        ll_experts=args.ll_experts,
        iterations=args.iterations,
        warmup=args.warmup,
    )


def run_channel(args, report):
    from portep_bench import channel

    channel.run(
        report,
        ranks=args.ranks,
        transports=tuple(args.transport or ("shm", "shm-unordered")),
        threads=args.proxy_threads,
        producers=args.producers,
        messages=args.messages,
        msg_bytes=args.message_bytes,
        signal_every=args.signal_every,
        sizes=tuple(args.sizes),
        iterations=args.iterations,
    )


def run_gpu_fifo(args, report):
    from portep_bench import gpu_fifo

    gpu_fifo.run(report)


def run_gpu_ll(args, report):
    from portep_bench import ll_gpu

    ll_gpu.run(
        report,
        tokens=args.tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        iterations=args.iterations,
        proxy_transport=args.proxy_transport,
        with_proxy=not args.no_proxy,
    )
    ll_gpu.run_channel(report)


def run_gpu_ht(args, report):
    from portep_bench import ht_gpu

    ht_gpu.run(
        report,
        tokens=args.tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        iterations=args.iterations,
        sms_list=tuple(args.sms),
    )


def run_gpu(args, report):
    from portep_bench import ht_gpu, ll_gpu

    ll_gpu.run(report)
    ll_gpu.run_channel(report)
    ht_gpu.run(report)


def run_loopback(args, report):
    from portep_bench import ht_loopback

    ht_loopback.run(
        report, sms_list=tuple(args.sms), iterations=args.iterations, masks=tuple(args.masks), check=not args.no_check
    )


def run_nodes_loopback(args, report):
    """python -m portep_bench gpu-ht-nodes."""
    from portep_bench import ht_nodes_loopback

    ht_nodes_loopback.run(
        report,
        sms_list=tuple(args.sms),
        tokens=args.tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        iterations=args.iterations,
        transport=args.transport,
        nodes=args.nodes,
        timeout_s=args.timeout,
    )


def run_gpu_ep(args, report):
    from portep_bench import ep_gpu

    ep_gpu.run(
        report,
        tokens=args.tokens,
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        sms=args.sms,
        iterations=args.iterations,
    )


def run_ll_host(args, report):
    from portep_bench import ll_host_time

    report.progress(f"ll-host: {args.calls} calls per row")
    try:
        result = ll_host_time.measure(args.calls, report.progress, args.profile)
    except RuntimeError as e:  # the contract's way of saying this machine cannot run it (no GPU)
        raise MissingHardware(str(e)) from e
    report.say(f"ll-host: {result['note']}")
    t = Table(f"ll-host: host time of the LL calls, {args.calls} calls per row", "us", result["note"])
    for row in result["rows"]:
        t.add(row["what"], row["samples_us"])
    report.add(t)
    if result["profile"]:
        report.say(result["profile"])


RUNNERS = {
    "ep": run_ep,
    "channel": run_channel,
    "gpu-fifo": run_gpu_fifo,
    "gpu-ll": run_gpu_ll,
    "gpu-ht": run_gpu_ht,
    "gpu": run_gpu,
    "gpu-ht-loopback": run_loopback,
    "gpu-ht-nodes": run_nodes_loopback,
    "gpu-ep": run_gpu_ep,
    "ll-host": run_ll_host,
}


def finish(report, json_path, plot_dir):
    if json_path:
        report.write_json(json_path)
        report.progress(f"wrote {json_path}")
    if plot_dir and not plot.available():
        print(f"no plots: matplotlib is not installed; for plots: {plot.HOW_TO_GET}", file=sys.stderr)
    elif plot_dir and report.tables:
        paths = plot.write(report.tables, plot_dir)
        report.progress(f"wrote {len(paths)} plots to {plot_dir}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    runs = parse(argv)
    json_path, plot_dir = runs[0].json, runs[0].plot
    if plot_dir and not plot.available():
        print(
            f"--plot: matplotlib is not installed, so this run writes no plots ({plot.HOW_TO_GET} for them); "
            "the tables and --json are written as usual",
            file=sys.stderr,
        )
    progress = Progress()
    modes = [a.mode for a in runs]
    widen_hardware_queues(modes)
    report = Report(" ".join(["python -m portep_bench"] + [shlex.quote(a) for a in argv]), modes, progress)
    report.say(f"portep_bench: {' then '.join(modes)}; {report.machine_line()}")
    status = 0
    for args in runs:
        progress(f"{args.mode}: start")
        try:
            RUNNERS[args.mode](args, report)
        except MissingHardware as e:
            print(f"portep_bench {args.mode}: {e}", file=sys.stderr)
            status = 1
            break
    finish(report, json_path, plot_dir)
    progress(f"done ({len(report.tables)} tables)")
    return status


if __name__ == "__main__":
    sys.exit(main())
