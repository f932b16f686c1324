#!/usr/bin/env python3
"""Summarise a DS4_CUDA_TRACE kernel trace (CSV from ds4-bench) of decode tokens.

    bench/trace-summary.py TRACE.csv [--token K] [--timeline]

A decode token is one replay of the token graph: it starts at a graph-launched
`embed` kernel. The token before the last is summarised unless --token picks another
(0 = first decode token of the trace, negative = from the end).

Inside a graph replay CUPTI reports the graph's own internal streams, not the lanes the
graph was captured from, so this works from time alone:

* the token's wall time, the time any kernel runs (busy) and the time none does (idle),
  and how long 1, 2, 3 or more kernels run at once;
* per kernel name: launches, summed duration, *exclusive* time (while it ran alone)
  and *shared* time (its share while others ran too). Exclusive + shared over all
  names adds up to the busy time;
* the *critical chain*: from the last kernel to end, each kernel's predecessor is the
  one that ended last before it started. Per name: launches on the chain, run time and
  the gap before (launch latency or a wait). With programmatic dependent launch on
  (the default) kernels start before their predecessor ends and report that wait as
  run time, so trace with DS4_CUDA_PDL=0 to read the chain;
* with --timeline, every kernel of the token (µs from its start, * = on the chain);
* with --around NAME, each launch of kernel NAME in the token with the kernels that ran
  beside it (and for how long) and the one it followed on the chain: what a kernel
  shares the GPU with in the graph, which a stand-alone timing does not see;
* with --halves, the wall time of each layer half, from one HC end (`hc_post_pl`, or
  `hc_post_gram` under the default `hc_gram`) to the next, summed by kind (attention of a window-only, ratio-128 or indexed layer; FFN).
  End to end, so it reads a trace with programmatic dependent launch on (the default),
  where kernels start early and the chain does not apply.
"""
import argparse
import bisect
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


def sweep(tok):
    """Exclusive and shared time per kernel name, busy time, and time at each concurrency."""
    ev = []
    for i, r in enumerate(tok):
        ev.append((r[2], 1, i))
        ev.append((r[3], -1, i))
    ev.sort(key=lambda e: (e[0], e[1]))
    active = set()
    excl, shared = defaultdict(float), defaultdict(float)
    conc = defaultdict(float)
    busy = 0.0
    prev = ev[0][0]
    for t, kind, i in ev:
        dt = t - prev
        if dt > 0 and active:
            busy += dt
            conc[min(len(active), 4)] += dt
            if len(active) == 1:
                excl[tok[next(iter(active))][0]] += dt
            else:
                for j in active:
                    shared[tok[j][0]] += dt / len(active)
        prev = t
        if kind == 1:
            active.add(i)
        else:
            active.discard(i)
    return excl, shared, conc, busy


def last_ended(tok):
    """A function: time t -> index of the kernel that ended last at or before t (or None)."""
    by_end = sorted(range(len(tok)), key=lambda i: tok[i][3])
    ends = [tok[i][3] for i in by_end]

    def at(t):
        j = bisect.bisect_right(ends, t) - 1
        return by_end[j] if j >= 0 else None

    return at


def chain(tok):
    """Indices of the critical chain, last kernel first."""
    before = last_ended(tok)
    out = [before(max(r[3] for r in tok))]  # the last kernel to end
    while True:
        # the kernel that ended last at or before the current one's start
        j = before(tok[out[-1]][2])
        if j is None:
            break
        out.append(j)
    return out


def halves(tok):
    """Wall µs of each layer half (one HC end to the next) by kind."""
    t = sorted(tok, key=lambda r: r[3])
    ends = [r[3] for r in t if r[0] in ("hc_post_pl", "hc_post_gram")]
    prev = tok[0][2]
    out = defaultdict(lambda: [0, 0.0])
    for e in ends:
        names = {r[0] for r in t if prev < r[3] <= e}
        if any("iq2" in n or "q2_k" in n or "q4_k" in n for n in names):
            kind = "ffn"
        elif any(n.startswith("indexer") for n in names):
            kind = "attention, indexed"
        elif any(n.startswith("compressor") for n in names):
            kind = "attention, compressed"
        else:
            kind = "attention, window only"
        out[kind][0] += 1
        out[kind][1] += (e - prev) / 1e3
        prev = e
    return out, (t[-1][3] - prev) / 1e3


def around(tok, name, on_chain):
    """Each launch of `name`: the kernels overlapping it, and the chain predecessor."""
    t0 = tok[0][2]
    idx = [i for i, r in enumerate(tok) if r[0] == name]
    if not idx:
        sys.exit(f"no kernel named {name} in this token")
    before = last_ended(tok)
    total = defaultdict(lambda: [0, 0.0])
    durs = []
    print(f"\n{name}: {len(idx)} launches (µs from the token's start; * = on the chain)")
    for i in idx:
        s0, e0 = tok[i][2], tok[i][3]
        durs.append(e0 - s0)
        j = before(s0)
        pred = tok[j] if j is not None else None
        tag = "*" if i in on_chain else " "
        after = f", after {pred[0]} (ended {(s0 - pred[3]) / 1e3:.2f} µs before)" if pred else ""
        print(f"  {(s0 - t0) / 1e3:9.2f} {(e0 - t0) / 1e3:9.2f} {(e0 - s0) / 1e3:7.2f} {tag}{after}")
        beside = defaultdict(float)
        for k, r in enumerate(tok):
            if k == i:
                continue
            ov = min(e0, r[3]) - max(s0, r[2])
            if ov > 0:
                beside[r[0]] += ov
        for other, ov in sorted(beside.items(), key=lambda kv: -kv[1]):
            print(f"      beside {other:<28} {ov / 1e3:7.2f} µs")
            total[other][0] += 1
            total[other][1] += ov
    mean = sum(durs) / len(durs)
    print(f"  mean {mean / 1e3:.2f} µs a launch; beside it over all launches:")
    for other, (n, ov) in sorted(total.items(), key=lambda kv: -kv[1][1]):
        print(f"    {other:<28} {n:>4} launches {ov / 1e3:9.2f} µs")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--token", type=int, default=-2, help="which decode token (default -2: the one before the last)")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--halves", action="store_true", help="wall time per layer half (PDL on)")
    ap.add_argument("--around", metavar="NAME", help="each launch of kernel NAME and what ran beside it")
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
    wall = t1 - t0
    excl, shared, conc, busy = sweep(tok)
    print(f"{len(toks)} decode tokens; token {a.token}: {len(tok)} kernels, {wall / 1e3:.1f} µs")
    print(f"  busy {busy / 1e3:.1f} µs, idle {(wall - busy) / 1e3:.1f} µs")
    print("  running at once: " + ", ".join(
        f"{'4+' if k == 4 else k}: {conc[k] / 1e3:.1f} µs" for k in sorted(conc)))
    if a.halves:
        by_kind, tail = halves(tok)
        print("\nlayer halves (wall, end to end):")
        print(f"  {'kind':<24} {'n':>4} {'µs':>9} {'µs each':>9}")
        for kind, (n, us) in sorted(by_kind.items()):
            print(f"  {kind:<24} {n:>4} {us:>9.1f} {us / n:>9.2f}")
        print(f"  {'after the last layer':<24} {'':>4} {tail:>9.1f}")
        return

    run = defaultdict(lambda: [0, 0])
    for r in tok:
        e = run[r[0]]
        e[0] += 1
        e[1] += r[3] - r[2]
    print("\nper kernel, by exclusive + shared time:")
    print(f"  {'kernel':<28} {'n':>5} {'run µs':>9} {'excl µs':>9} {'shared µs':>9}")
    for name, (n, d) in sorted(run.items(), key=lambda kv: -(excl[kv[0]] + shared[kv[0]])):
        print(f"  {name:<28} {n:>5} {d / 1e3:>9.1f} {excl[name] / 1e3:>9.1f} {shared[name] / 1e3:>9.1f}")

    ch = chain(tok)
    on_chain = set(ch)
    agg = defaultdict(lambda: [0, 0, 0])
    for pos, k in enumerate(ch):
        e = agg[tok[k][0]]
        e[0] += 1
        e[1] += tok[k][3] - tok[k][2]
        if pos + 1 < len(ch):
            e[2] += tok[k][2] - tok[ch[pos + 1]][3]
    tot_run = sum(e[1] for e in agg.values())
    tot_gap = sum(e[2] for e in agg.values())
    print(f"\ncritical chain: {len(ch)} kernels, run {tot_run / 1e3:.1f} µs + gaps {tot_gap / 1e3:.1f} µs")
    print(f"  {'kernel':<28} {'n':>5} {'run µs':>9} {'gap µs':>9}")
    for name, (n, d, g) in sorted(agg.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"  {name:<28} {n:>5} {d / 1e3:>9.1f} {g / 1e3:>9.1f}")
    if a.around:
        around(tok, a.around, on_chain)
    if a.timeline:
        print("\ntimeline (µs from the token's start; * = on the critical chain):")
        for i, r in enumerate(tok):
            tag = "*" if i in on_chain else " "
            print(f"  {(r[2] - t0) / 1e3:9.2f} {(r[3] - t0) / 1e3:9.2f} {(r[3] - r[2]) / 1e3:7.2f} {tag} {r[0]}")


if __name__ == "__main__":
    main()
