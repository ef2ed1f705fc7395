"""pilotrun's time per update against step times other projects measured on real GPUs and published.

    .venv/bin/python bench/published_time.py                         # the jobs in bench/published/times.yaml
    .venv/bin/python bench/published_time.py --jobs other/times.yaml # measurements kept elsewhere, same format
    .venv/bin/python bench/published_time.py --only MPT-7B           # the jobs whose name contains it
    .venv/bin/python bench/published_time.py --only nanoGPT --tag attention  # results: published_time-attention-...

Each job runs ``pilotrun estimate SPEC --set ... --accelerator A --strategy S --gpus N --json`` and compares its
``seconds_per_update`` with the published one. The goal is within ±25%. Beside the time model's answer (each op
the larger of its FLOPs at the peak and its bytes at the bandwidth, model.seconds_per_update) the same trace is
also timed as before it, FLOPs at the catalog's default utilisation, so the change shows on every row. Nothing in
pilotrun was fit to these rows except where the catalog says so (its ``efficiency`` entries name the row they were
taken from); the script prints which rows those are.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402

from pilotrun import strategies  # noqa: E402
from pilotrun.estimate.catalog import find, load_catalog  # noqa: E402

JOBS = REPO / "bench" / "published" / "times.yaml"
GOAL = 0.25


def estimate(spec: Path, job: dict) -> dict:
    cmd = [sys.executable, "-m", "pilotrun", "estimate", str(spec), "--accelerator", job["accelerator"],
           "--strategy", job["strategy"], "--gpus", str(job["gpus"]), "--no-advice", "--json"]
    if job.get("catalog"):
        cmd += ["--catalog", str(spec.parent / job["catalog"])]
    for item in job.get("set", []):
        cmd += ["--set", item]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr}")
    return json.loads(res.stdout)


def flops_only_seconds(fit: dict, default_utilisation: float) -> float | None:
    """What the estimate said before the time model: FLOPs over the dense peak x the default utilisation, plus the
    same communication."""
    t = fit["time"]
    if not t.get("peak_flops"):
        return None
    replicas = strategies.get(fit["strategy"]).compute_replicas(fit["gpus"])
    return t["flops_per_update"] / replicas / (t["peak_flops"] * default_utilisation) + t["communication_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=Path, default=JOBS,
                    help="a YAML file of published jobs in bench/published/times.yaml's format (its specs beside it)")
    ap.add_argument("--only", default="", help="run only the jobs whose name contains this text")
    ap.add_argument("--tag", default="", help="results file published_time-TAG-<device>-<date>.json (a partial run "
                                              "then leaves the day's full results in place)")
    args = ap.parse_args()
    try:
        data = yaml.safe_load(args.jobs.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"--jobs {args.jobs}: cannot read it ({exc}); give a file in the format of "
                         f"{JOBS.relative_to(REPO)}") from None
    jobs = [j for j in (data or {}).get("jobs", []) if args.only in j.get("name", "")]
    if not jobs:
        raise SystemExit(f"--jobs {args.jobs}: no job" + (f" whose name contains {args.only!r}" if args.only else "")
                         + f"; each is an entry under jobs: as in {JOBS.relative_to(REPO)}")
    catalog = load_catalog()
    extra = {j["catalog"] for j in jobs if j.get("catalog")}
    for path in extra:   # the jobs' own accelerators, for their default utilisation
        catalog = {**catalog, **load_catalog(args.jobs.parent / path)}
    rows = []
    print(f"{'job':52} {'published':>9} {'estimate':>9} {'ratio':>6} {'memory-bound':>12} {'flops-only':>10} "
          f"{'ratio':>6}  efficiency from")
    for job in jobs:
        est = estimate(args.jobs.parent / job["spec"], job)
        fit = est["fits"][0]
        t = fit["time"]
        published = float(job["published_seconds_per_update"])
        seconds = fit["seconds_per_update"]
        old = flops_only_seconds(fit, float(find(catalog, job["accelerator"]).defaults.get("utilisation", 0.4)))
        row = {"job": job["name"], "source": job["source"], "spec": f"{args.jobs.parent.name}/{job['spec']}",
               "set": job.get("set", []), "accelerator": job["accelerator"], "strategy": job["strategy"],
               "gpus": job["gpus"], "published_seconds_per_update": published, "estimated_seconds_per_update": seconds,
               "ratio": round(seconds / published, 4) if seconds else None,
               "memory_bound_seconds": t.get("memory_bound_seconds"), "model": t.get("model"),
               "efficiency_source": t.get("efficiency_source"), "flops_only_seconds": old,
               "flops_only_ratio": round(old / published, 4) if old else None,
               # The estimate calls its time a lower bound (matmuls off the tensor cores' alignment, estimate/
               # alignment.py): the row says so beside its ratio.
               "lower_bound": (t.get("unaligned_matmuls") or {}).get("note")}
        rows.append(row)
        nan = float("nan")
        print(f"{job['name']:52} {published:>8.3f}s {seconds or nan:>8.3f}s {row['ratio'] or nan:>6.3f} "
              f"{(t.get('memory_bound_seconds') or 0):>11.3f}s {old or nan:>9.3f}s "
              f"{row['flops_only_ratio'] or nan:>6.3f}  {t.get('efficiency_source', '')[:60]}"
              + ("  [the estimate says: a lower bound, unaligned matmuls]" if row["lower_bound"] else ""))
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    old_ratios = [r["flops_only_ratio"] for r in rows if r["flops_only_ratio"]]
    within = sum(abs(x - 1) <= GOAL for x in ratios)
    summary = {"jobs": len(rows), "within_goal": within, "goal": f"±{GOAL:.0%}",
               "median_ratio": statistics.median(ratios) if ratios else None,
               "worst_ratio": max(ratios, key=lambda x: abs(x - 1)) if ratios else None,
               "flops_only_within_goal": sum(abs(x - 1) <= GOAL for x in old_ratios),
               "flops_only_median_ratio": statistics.median(old_ratios) if old_ratios else None}
    print(f"\n{within} of {len(rows)} within ±{GOAL:.0%} (median ratio {summary['median_ratio']:.3f}, worst "
          f"{summary['worst_ratio']:.3f}); FLOPs at the default utilisation: {summary['flops_only_within_goal']} of "
          f"{len(old_ratios)} (median {summary['flops_only_median_ratio']:.3f})")
    write_results("published_time" + (f"-{args.tag}" if args.tag else ""),
                  {"jobs_file": str(args.jobs), "only": args.only or None, "machine": machine(), "summary": summary,
                   "rows": rows})


if __name__ == "__main__":
    main()
