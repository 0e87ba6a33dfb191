"""Summarise mpi4py_suite.py's output directories: per module, counts (a test fails if it
fails on any rank), and the failing ids.

Usage: ``python tests/mpi/mpi4py_summary.py OUTDIR [OUTDIR ...] [--details]``
"""
import collections
import glob
import json
import os
import sys

details = "--details" in sys.argv
for out in [a for a in sys.argv[1:] if not a.startswith("--")]:
    files = sorted(glob.glob(os.path.join(out, "rank*.json")))
    logs = sorted(glob.glob(os.path.join(out, "rank*.log")))
    if not files:
        print(f"== {out}: NO RESULT (hang/crash?)")
        for lg in logs:
            with open(lg) as fh:
                lines = fh.read().splitlines()
            print(f"   {os.path.basename(lg)} last: {lines[-1] if lines else '-'}")
        continue
    ranks = []
    for f in files:
        with open(f) as fh:
            ranks.append(json.load(fh))
    outcome = collections.defaultdict(dict)   # id -> rank -> outcome
    detail = {}
    for r in ranks:
        for rec in r["records"]:
            o = rec["outcome"]
            prev = outcome[rec["id"]].get(r["rank"])
            if prev in ("fail", "error"):
                continue
            outcome[rec["id"]][r["rank"]] = o
            if o in ("fail", "error") and rec["id"] not in detail:
                detail[rec["id"]] = rec["detail"]
    per_mod = collections.defaultdict(collections.Counter)
    failing = []
    for tid, by_rank in outcome.items():
        mod = tid.split(".")[0]
        vals = set(by_rank.values())
        if vals & {"fail", "error"}:
            per_mod[mod]["fail"] += 1
            failing.append(tid)
        elif vals == {"skip"}:
            per_mod[mod]["skip"] += 1
        else:
            per_mod[mod]["pass"] += 1
    n = ranks[0]["size"]
    print(f"== {out}: mode={ranks[0]['mode']} N={n} ranks_reported={len(ranks)} "
          f"total_s(rank0)={ranks[0]['total_seconds']}")
    for mod in sorted(per_mod):
        c = per_mod[mod]
        print(f"   {mod:22s} pass={c['pass']:4d} fail={c['fail']:3d} skip={c['skip']:3d}"
              f"  ({ranks[0]['module_seconds'].get(mod, '?')} s)")
    for tid in sorted(failing):
        print(f"   FAIL {tid}")
        if details:
            print("      " + detail[tid].strip().splitlines()[-1][:300])
