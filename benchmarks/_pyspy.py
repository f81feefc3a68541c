"""Where a worker's time goes, from ``py-spy record --format raw`` (collapsed stacks).

    .venv/bin/python benchmarks/_pyspy.py PROFILE.txt [--top 25] [--self]

Shares are of all non-idle samples: inclusive (a function counted once per stack it is on)
or, with ``--self``, only where it was the innermost frame. Frames are grouped by function
and file, line numbers dropped.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def shares(path: Path, innermost: bool, without: list[str]) -> tuple[int, Counter[str]]:
    """(samples, samples per function); stacks with a frame that contains one of
    ``without`` are left out (``_find_and_load``: start-up imports)."""
    total = 0
    per: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        if any(w in stack for w in without):
            continue
        n = int(count)
        total += n
        frames = [_LINE.sub(")", f.replace("site-packages/", "")) for f in stack.split(";")]
        for frame in [frames[-1]] if innermost else set(frames):
            per[frame] += n
    return total, per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--self", dest="innermost", action="store_true")
    parser.add_argument(
        "--without",
        action="append",
        default=["_find_and_load"],
        help="leave out stacks with a frame containing this (default: imports)",
    )
    args = parser.parse_args()
    total, per = shares(args.profile, args.innermost, args.without)
    print(f"{total:,} samples ({'self' if args.innermost else 'inclusive'})")
    for frame, n in per.most_common(args.top):
        print(f"{n / max(1, total):6.1%}  {frame[:150]}")


if __name__ == "__main__":
    main()
