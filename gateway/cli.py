"""The `slogate` command: `serve` runs the gateway, `demo` runs it in front of the simulator
with a short load, `hash-key` hashes a gateway key. Packages add subcommands through the
`slogate.commands` entry point group (the simulator's `sim` comes from backends/sim that way).
"""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay runnable without it
        return
    uvloop.install()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slogate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", required=True, help="TOML config file")
    serve.add_argument("--host", help="listen address (overrides [server].host)")
    serve.add_argument("--port", type=int, help="listen port (overrides [server].port)")

    sub.add_parser("hash-key", help="print the sha256 of a gateway key read from stdin "
                   "(for [[auth.keys]] sha256)")

    demo = sub.add_parser("demo", help="simulator + gateway + a short load, then keep serving")
    demo.add_argument("--duration", type=float, help="exit after this many seconds")
    demo.add_argument("--port", type=int, default=8080, help="gateway port")
    demo.add_argument("--sim-port", type=int, default=8000, help="simulator port")
    demo.add_argument("--concurrency", type=int, default=8, help="concurrent client streams")

    for command in entry_points(group="slogate.commands"):
        command.load()(sub)  # each adds its subparser with a `run(args) -> int` default
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _install_uvloop()
    run = getattr(args, "run", None)
    if run is not None:  # a subcommand from the entry point group
        return int(run(args))
    if args.command == "hash-key":
        from gateway.auth import hash_key

        key = sys.stdin.readline().strip()
        if not key:
            print("slogate hash-key: no key on stdin", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    if args.command == "demo":
        from gateway import demo

        return demo.run(args.duration, args.port, args.sim_port, args.concurrency)
    from gateway import server

    return server.run(args.config, host=args.host, port=args.port)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
