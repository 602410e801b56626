"""The scheduler's time per request against an earlier revision, same run (issue 25's budget).

``python3 benches/replay_against.py [--baseline REV] [--rounds N] [--cpu C]`` builds this checkout
and revision ``REV`` (by default 4bf4794, the scheduler before the eviction engine's rewrite) with
the same command, ``cargo build --release -p kvshm --bin kvshm``, each into its own ``target``
(``CARGO_TARGET_DIR`` is overridden): code layout alone moves this replay, so both binaries must
come from one command. The baseline's sources are exported with ``git archive`` into
``$XDG_CACHE_HOME/kvshm/replay-baseline-COMMIT`` (``~/.cache`` by default, the commit's first 12
hex digits) and built there once; later runs reuse that build.

Each round runs ``kvshm replay`` of the Mooncake conversation trace in two configurations
(5,859 device blocks; 1,953 device + 7,812 host blocks), both binaries back to back, the order
alternating between rounds (an even number of rounds runs each first equally often), pinned to
CPU ``C`` when given (``taskset``). It prints one JSON object: the checkout's commit (``-dirty``
with uncommitted changes: the working tree is what is built), per configuration the median and
range of each binary's per-request p50 and p99 over the rounds, the ratios current / baseline of
the medians, and whether the hit counts are identical (they must be: ``tests/replay_figures.rs``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "mooncake_conversation_trace.jsonl"
BUILD = ["cargo", "build", "--release", "-q", "-p", "kvshm", "--bin", "kvshm"]
CONFIGS = {
    "device 5859": ["--device-blocks", "5859"],
    "device 1953 + host 7812": ["--device-blocks", "1953", "--host-blocks", "7812"],
}


def build(source: Path) -> Path:
    """Builds ``kvshm`` in ``source`` with the one command both binaries share, into
    ``source/target`` whatever the environment or cargo's configuration say."""
    target = source / "target"
    subprocess.run(
        BUILD, cwd=source, check=True, env={**os.environ, "CARGO_TARGET_DIR": str(target)}
    )
    return target / "release" / "kvshm"


def baseline_sources(revision: str) -> Path:
    """The sources of ``revision``, exported once into the cache directory."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{revision}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvshm"
    directory = cache / f"replay-baseline-{commit[:12]}"
    if not (directory / "Cargo.toml").exists():
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(partial)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            sys.exit(f"git archive {commit} failed")
        partial.rename(directory)
    return directory


def replay(binary: Path, config: list[str], cpu: int | None) -> dict[str, float]:
    """One replay of the whole trace: its per-request p50 and p99 (µs) and hit blocks."""
    command = [str(binary), "replay", "--trace", str(TRACE), "--json", *config]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    report = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
    times = report["sched_us_per_request"]
    return {"p50": times["p50"], "p99": times["p99"], "hits": report["hit_blocks"]}


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--baseline", default="4bf4794", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of both binaries")
    parser.add_argument("--cpu", type=int, help="pin every replay to this CPU")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    current = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=12"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    binaries = {"baseline": build(baseline_sources(args.baseline)), "current": build(ROOT)}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {"baseline": [], "current": []} for name in CONFIGS
    }
    for round_index in range(args.rounds):
        order = ["baseline", "current"] if round_index % 2 == 0 else ["current", "baseline"]
        for name, config in CONFIGS.items():
            for which in order:
                runs[name][which].append(replay(binaries[which], config, args.cpu))
    result: dict[str, object] = {
        "baseline": args.baseline,
        "current": current,
        "rounds": args.rounds,
    }
    for name, by_binary in runs.items():
        entry: dict[str, object] = {}
        for which, reports in by_binary.items():
            entry[which] = {
                quantile: summary([report[quantile] for report in reports])
                for quantile in ("p50", "p99")
            }
        for quantile in ("p50", "p99"):
            ours = statistics.median(report[quantile] for report in by_binary["current"])
            theirs = statistics.median(report[quantile] for report in by_binary["baseline"])
            entry[f"ratio_{quantile}"] = round(ours / theirs, 3)
        hits = {report["hits"] for reports in by_binary.values() for report in reports}
        entry["hits_identical"] = len(hits) == 1
        entry["hit_blocks"] = sorted(hits)
        result[name] = entry
    print(json.dumps(result))


if __name__ == "__main__":
    main()
