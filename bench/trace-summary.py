#!/usr/bin/env python3
"""Summarise a DS4_CUDA_TRACE kernel trace (CSV from ds4-bench) of decode tokens.

    bench/trace-summary.py TRACE.csv [--token K] [--timeline]

A decode token is one replay of the token graph: it starts at a graph-launched
`embed` kernel. The token before the last is summarised unless --token picks another
(0 = first decode token of the trace, negative = from the end). Printed:

* the token's wall time, and per stream (lane) its busy time;
* per kernel name on the main stream (the one `embed` runs on): launches, summed
  duration, and summed *wait* before it (start minus the previous main-stream
  kernel's end; negative when programmatic dependent launch overlapped them). The
  waits show where the main lane stalls on a join or on launch latency;
* per kernel name on the side streams: launches and summed duration;
* with --timeline, every kernel of the token (µs from its start).
"""
import argparse
import csv
import sys
from collections import defaultdict


def load(path):
    with open(path, newline="") as f:
        rows = [
            (r["name"], int(r["stream"]), int(r["start_ns"]), int(r["end_ns"]), int(r["graph_node"]))
            for r in csv.DictReader(f)
        ]
    rows.sort(key=lambda r: (r[2], r[3]))
    return rows


def tokens(rows):
    """Splits the graph-launched kernels into replays, each starting at `embed`."""
    out, cur = [], None
    for r in rows:
        if r[4] == 0:
            continue
        if r[0] == "embed":
            if cur:
                out.append(cur)
            cur = []
        if cur is not None:
            cur.append(r)
    if cur:
        out.append(cur)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--token", type=int, default=-2, help="which decode token (default -2: the one before the last)")
    ap.add_argument("--timeline", action="store_true")
    a = ap.parse_args()
    rows = load(a.trace)
    toks = tokens(rows)
    if not toks:
        sys.exit("no graph-launched embed kernel in the trace: was it a decode run with graphs on?")
    try:
        tok = toks[a.token]
    except IndexError:
        sys.exit(f"{len(toks)} tokens in the trace; --token {a.token} is out of range")
    t0 = tok[0][2]
    t1 = max(r[3] for r in tok)
    main_stream = tok[0][1]
    print(f"{len(toks)} decode tokens; token {a.token}: {len(tok)} kernels, {(t1 - t0) / 1e3:.1f} µs")

    busy = defaultdict(int)
    for r in tok:
        busy[r[1]] += r[3] - r[2]
    for s, b in sorted(busy.items(), key=lambda kv: -kv[1]):
        tag = "main" if s == main_stream else "side"
        print(f"  stream {s} ({tag}): busy {b / 1e3:.1f} µs ({100 * b / (t1 - t0):.0f}% of the token)")

    main_k = defaultdict(lambda: [0, 0, 0])
    side_k = defaultdict(lambda: [0, 0])
    prev_end = None
    for r in tok:
        d = r[3] - r[2]
        if r[1] == main_stream:
            e = main_k[r[0]]
            e[0] += 1
            e[1] += d
            if prev_end is not None:
                e[2] += r[2] - prev_end
            prev_end = r[3]
        else:
            e = side_k[r[0]]
            e[0] += 1
            e[1] += d
    print("\nmain stream, by summed duration + wait before:")
    print(f"  {'kernel':<28} {'n':>5} {'run µs':>9} {'wait µs':>9}")
    total_run = total_wait = 0
    for name, (n, run, wait) in sorted(main_k.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        total_run += run
        total_wait += wait
        print(f"  {name:<28} {n:>5} {run / 1e3:>9.1f} {wait / 1e3:>9.1f}")
    print(f"  {'(total)':<28} {'':>5} {total_run / 1e3:>9.1f} {total_wait / 1e3:>9.1f}")
    print("\nside streams, by summed duration:")
    for name, (n, run) in sorted(side_k.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<28} {n:>5} {run / 1e3:>9.1f}")
    if a.timeline:
        print("\ntimeline (µs from the token's start):")
        for r in tok:
            tag = "M" if r[1] == main_stream else f"s{r[1]}"
            print(f"  {(r[2] - t0) / 1e3:9.2f} {(r[3] - t0) / 1e3:9.2f} {(r[3] - r[2]) / 1e3:7.2f} {tag:>4} {r[0]}")


if __name__ == "__main__":
    main()
