"""Run one probe by name: ``python -m benchmarks.probe NAME [--options]`` (no NAME: the list).

Every probe is a module of `benchmarks.probes` with `main(argv)`, registered in
`benchmarks.probes.PROBES`; its options are its own argparse options (``NAME --help``).
"""

from __future__ import annotations

import importlib
import sys

from benchmarks.probes import PROBES


def usage() -> str:
    width = max(map(len, PROBES))
    lines = ["usage: python -m benchmarks.probe NAME [--options]   (NAME --help: its options)", "", "probes:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in PROBES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in PROBES:
        print(f"benchmarks.probe: no probe named {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.probes.{PROBES[name][0]}")
    sys.argv[0] = f"python -m benchmarks.probe {name}"  # argparse's prog in each probe's usage
    result = module.main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
