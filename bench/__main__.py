"""``python -m bench NAME [options]``: run benchmark NAME (see :mod:`bench`)."""
import runpy
import sys

from bench import BENCHMARKS


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help") or sys.argv[1] not in BENCHMARKS:
        names = ", ".join(sorted(set(BENCHMARKS)))
        print(f"usage: python -m bench NAME [options]\nNAME: {names}", file=sys.stderr)
        sys.exit(0 if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help") else 2)
    module = BENCHMARKS[sys.argv[1]]
    sys.argv = [f"bench.{module}", *sys.argv[2:]]
    runpy.run_module(f"bench.{module}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
