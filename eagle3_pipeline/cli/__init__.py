"""`eagle3-pipeline …`: run the main job on a Dagster instance, show the pipeline's status or plan, or see
and stop its managed inference server."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from eagle3_pipeline.cli.cmd_fit import add_fit_parser
from eagle3_pipeline.cli.cmd_plan import cmd_plan
from eagle3_pipeline.cli.cmd_run import cmd_run
from eagle3_pipeline.cli.cmd_server import cmd_server
from eagle3_pipeline.cli.cmd_status import cmd_status
from eagle3_pipeline.cli.errors import report
from eagle3_pipeline.cli.shared import close_tunnels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-pipeline",
        description=__doc__,
        epilog="A command that fails ends in one line on stderr saying what is wrong and what to do; its exit "
        "code: 0 done / healthy / running, 1 unhealthy / failed / left behind / does not fit, 2 bad pipeline file "
        "or command line, 3 server not running, 4 host unreachable, 5 host key unknown or changed, 6 host refused "
        "the credentials, 70 unexpected error (a bug).",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error as well")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialize every asset and partition (the main job)")
    run.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    run.set_defaults(func=cmd_run)
    status = sub.add_parser("status", help="health checks, per-dataset progress and runs in flight")
    status.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    status.add_argument("--json", action="store_true", help="print {overall, checks, datasets} as JSON")
    status.add_argument("--host", help="with several inference hosts: the one to check (default: the first listed)")
    status.set_defaults(func=cmd_status)
    plan = sub.add_parser(
        "plan",
        help="per dataset and backend: tokens/s, tokens left, ETA, cost, and the best backend; "
        "then τ expected from more data of each dataset; "
        "then the hidden states' disk per backend and storage dtype; "
        "then the schedule on the GPU host: the managed server's starts and stops before each phase, and each "
        "phase's GPU time with its basis",
    )
    plan.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--calibrate", type=int, metavar="N", default=0, help="measure each backend with N real requests first"
    )
    plan.add_argument(
        "--max-cost",
        type=float,
        metavar="USD",
        default=None,
        help="the cost ceiling the best backend must finish within",
    )
    plan.set_defaults(func=cmd_plan)
    add_fit_parser(sub)
    server = sub.add_parser(
        "server",
        help="the managed inference server (serving.managed): its state (exit 0 running, 3 not running, 1 "
        "processes of it left without its leader or a foreign pid, 2 no managed server), or stop it, verified "
        "(processes, port, GPUs)",
    )
    server.add_argument("action", choices=["status", "stop"])
    server.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    server.add_argument("--host", help="with several inference hosts: whose managed server (default: the first)")
    server.set_defaults(func=cmd_server)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:
        return report(exc, debug=args.debug)
    finally:
        close_tunnels()
