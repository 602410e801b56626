"""``python -m kvshm worker ...``, ``tier-owner ...`` and ``kvctl ...``, from the installed package.

The tools are compiled into the extension module, so the wheel needs no separate binaries.
"""

import sys

from kvshm import _kvshm

USAGE = """usage: python -m kvshm <command> [arguments]

commands:
  worker      run the copy worker of one rank: worker --name NAME --rank R [--backend host|cuda]
  tier-owner  own a host tier several engines share: tier-owner --model M --block-bytes B ...
  kvctl       inspect and operate segments: kvctl ls | stat NAME | workers NAME | tree NAME | ...
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "worker":
        return _kvshm.run_worker(rest)
    if command == "tier-owner":
        return _kvshm.run_tier_owner(rest)
    if command == "kvctl":
        return _kvshm.run_kvctl(rest)
    print(f"python -m kvshm: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
