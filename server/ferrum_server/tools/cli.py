"""`ferrum-executor`: serve the executor, run the demo, or drive a server from the command line.

Every `serve` flag also reads the environment variable FERRUM_<FLAG> (dashes as underscores),
so containers can be configured either way; flags win over the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ferrum_server.cli import add_serve_command
from ferrum_server.tools.bench.cli import add_bench_args, cmd_bench
from ferrum_server.tools.demo import add_demo_args, cmd_demo
from ferrum_server.tools.generate import add_generate_args, cmd_generate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrum-executor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_command(sub)
    demo = sub.add_parser("demo", help="start a local server and drive a short generation")
    add_demo_args(demo)
    demo.set_defaults(func=cmd_demo)
    generate = sub.add_parser(
        "generate", help="generate with the reference scheduler (against --target or --local)"
    )
    add_generate_args(generate)
    generate.set_defaults(func=cmd_generate)
    bench = sub.add_parser(
        "bench", help="benchmark a fixed workload here and on transformers / vLLM"
    )
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
