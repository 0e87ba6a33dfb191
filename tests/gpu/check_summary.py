"""Summary and verdict of tests/gpu/check.sh: reads OUTDIR, writes OUTDIR/summary.md.

    python tests/gpu/check_summary.py OUTDIR

Exit status 0 only if every step succeeded, no test failed, and the GPU tests ran: any
test skipped because there is no GPU or no CuPy (reason starting with "GPU tests:"), or
no GPU test passed at all, fails the check loudly (a check that skipped its point must
not look green). Other skips (the dispatch hook not applied yet, MPI not CUDA-aware) are
listed but do not fail it.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

GPU_MODULES = ("test_gpu_cuda", "test_gpu_cupy")
NO_GPU = "GPU tests:"


def read_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip()
                break
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "message": message})
    return cases


def main(outdir: str) -> int:
    out = Path(outdir)
    problems: list[str] = []
    steps = {}
    steps_file = out / "steps.tsv"
    if steps_file.exists():
        for line in steps_file.read_text().splitlines():
            name, rc, secs = line.split("\t")
            steps[name] = (int(rc), float(secs))
    for name, (rc, _) in steps.items():
        if rc != 0:
            problems.append(f"step {name} exited with status {rc}")
    runs: dict[str, list[dict]] = {}
    for path in sorted(out.glob("junit-*.xml")):
        try:
            runs[path.stem] = read_junit(path)
        except ET.ParseError as exc:
            problems.append(f"{path.name}: unreadable ({exc})")
    gpu_passed = 0
    no_gpu: list[str] = []
    other_skips: dict[str, int] = {}
    for run, cases in runs.items():
        for c in cases:
            if c["outcome"] in ("failed", "error"):
                problems.append(f"{run}: {c['name']} {c['outcome']}")
            is_gpu = any(m in c["name"] for m in GPU_MODULES)
            if c["outcome"] == "skipped":
                msg = c["message"].removeprefix("Skipped: ")
                if msg.startswith(NO_GPU) or (is_gpu and "CuPy" in msg):
                    no_gpu.append(f"{run}: {c['name']}: {msg}")
                else:
                    other_skips[msg] = other_skips.get(msg, 0) + 1
            elif c["outcome"] == "passed" and is_gpu:
                gpu_passed += 1
    if no_gpu:
        problems.insert(0, f"GPU TESTS WERE SKIPPED ({len(no_gpu)}): {no_gpu[0]}")
    if gpu_passed == 0:
        problems.insert(0, "NO GPU TEST PASSED: the GPU tests did not run")
    info = {}
    if (out / "info.json").exists():
        info = json.loads((out / "info.json").read_text())
    bench = {}
    if (out / "bench-gpu.json").exists():
        bench = json.loads((out / "bench-gpu.json").read_text())
    lines = ["# GPU check", ""]
    meta = bench.get("meta", {})
    env = (out / "environment.txt").read_text() if (out / "environment.txt").exists() else ""
    lines += ["```", env.strip(), "```", ""]
    if info:
        ca = info.get("cuda_aware", {})
        lines += [f"- MPI: {info.get('mpi', {}).get('library')} "
                  f"({info.get('mpi', {}).get('thread_level')})",
                  f"- CUDA-aware: {ca.get('aware')} ({ca.get('decided_by')})",
                  f"- CuPy: {info.get('cupy', {}).get('version')}, devices "
                  f"{info.get('cupy', {}).get('devices')}",
                  f"- torch: {info.get('torch', {}).get('version')} "
                  f"(CUDA {info.get('torch', {}).get('cuda_build')})", ""]
    lines += ["## Steps", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {'ok' if rc == 0 else f'FAILED ({rc})'} | {s:.1f} |"
              for n, (rc, s) in steps.items()]
    lines += ["", "## Tests", "", "| run | passed | failed | skipped |", "|---|---|---|---|"]
    for run, cases in runs.items():
        count = {k: sum(1 for c in cases if c["outcome"] == k)
                 for k in ("passed", "failed", "error", "skipped")}
        lines.append(f"| {run} | {count['passed']} | {count['failed'] + count['error']} | "
                     f"{count['skipped']} |")
    lines += ["", f"GPU tests passed: {gpu_passed}", ""]
    if other_skips:
        lines += ["Other skips:", ""] + [f"- {n} x {m}" for m, n in other_skips.items()] + [""]
    if bench.get("results"):
        lines += ["## Benchmark (all-reduce, float32, "
                  f"{meta.get('world_size')} ranks, {meta.get('device')})", "",
                  f"`{meta.get('command')}`", "",
                  "| size | variant | max time (us) | algbw (GB/s) | vs host | vs unpipelined |",
                  "|---|---|---|---|---|---|"]
        for r in bench["results"]:
            lines.append(f"| {r['size']} | {r['algorithm']} | {r['max_us']:.1f} | "
                         f"{(r.get('algbw') or 0):.3f} | {(r.get('ratio') or 0):.2f} | "
                         f"{(r.get('vs_unpipelined') or 0):.2f} |")
        lines += [""] + [f"- {t}" for t in meta.get("targets", {}).get("lines", [])] + [""]
    verdict = "PASS" if not problems else "FAIL"
    lines += [f"## Verdict: {verdict}", ""] + [f"- {p}" for p in problems]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    if problems:
        banner = "!" * 78
        print(f"{banner}\nGPU CHECK FAILED\n" + "\n".join(f"  {p}" for p in problems[:20])
              + f"\n{banner}", file=sys.stderr)
        return 1
    print("GPU check passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
