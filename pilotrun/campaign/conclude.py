"""The campaign's conclusion: per variant, mean and spread over seeds, diverged runs counted, honest words.

A function from run records to numbers and sentences. The final validation loss is the metric
(lower is better); a variant "beats" the control only when, over the seeds both finished (at
least two), its mean is lower by more than the larger of the two seed spreads. With fewer
paired seeds there is no spread to judge by, and the text says so.

Each seed counts once: its first finished run in planned order (the declared run, or the retry of a
run that did not finish). A retry of a run that already finished never replaces it, so retrying
until a seed looks better cannot move the result. Runs on a drifted lock are not compared.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Sequence

from ..ledger.records import RunStatus


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def current(runs: list[dict]) -> list[dict]:
    """The runs that speak for the campaign: a row cut short by an interruption and run again by --resume
    is history, not another attempt (the new run, linked to it, speaks for it)."""
    continued = {r["meta"]["continues"] for r in runs if r["meta"].get("continues")}
    return [r for r in runs if r["run_id"] not in continued]


def variant_stats(runs: list[dict], value) -> dict:
    mine = [r for r in runs if r["meta"].get("variant") == value]
    finished, seen = [], set()
    for r in mine:  # planned order: declared runs first, then retries
        if (r["status"] == RunStatus.FINISHED and not r["meta"].get("lock_drift") and r["meta"].get("seed") not in seen
                and (r["meta"].get("final") or {}).get("val_loss") is not None):
            finished.append(r)
            seen.add(r["meta"].get("seed"))
    losses = [r["meta"]["final"]["val_loss"] for r in finished]
    by_seed = {r["meta"].get("seed"): r["meta"]["final"]["val_loss"] for r in finished}
    accs = [r["meta"]["final"].get("accuracy") for r in finished if r["meta"]["final"].get("accuracy") is not None]
    return {
        "variant": value,
        "runs": len(mine),
        "finished": len(finished),
        "diverged": sum(1 for r in mine if r["status"] == RunStatus.DIVERGED),
        "failed": sum(1 for r in mine if r["status"] in (RunStatus.FAILED, RunStatus.REFUSED)),
        "not_run": sum(1 for r in mine if r["status"] in (RunStatus.NOT_RUN, RunStatus.STOPPED)),
        "retries": sum(1 for r in mine if r["meta"].get("retry_of")),
        "continued": sum(1 for r in mine if r["meta"].get("continues")),
        "lock_drift": sum(1 for r in mine if r["meta"].get("lock_drift")),
        "val_loss_mean": statistics.fmean(losses) if losses else None,
        "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
        "accuracy_mean": statistics.fmean(accs) if accs else None,
        "seeds": sorted({r["meta"].get("seed") for r in finished}, key=str),
        "by_seed": by_seed,
        "declared_seeds": len({r["meta"].get("seed") for r in mine}),
        "stops": [{"run_id": r["run_id"], "status": r["status"], "reason": r["meta"].get("stop_reason"),
                   "at_update": r["meta"].get("stopped_at")} for r in mine if r["status"] != RunStatus.FINISHED],
    }


def conclude(key: str, values: list, runs: list[dict], interrupted: bool = False,
             caveats: Sequence[str] = ()) -> dict:
    """``caveats``: what was warned before the start (e.g. a warm-up longer than the runs), repeated at the end."""
    runs = current(runs)
    stats = [variant_stats(runs, v) for v in values]
    control = stats[0]
    lines: list[str] = []
    if interrupted:
        n = {k: sum(r["status"] == k for r in runs) for k in (RunStatus.FINISHED, RunStatus.STOPPED,
                                                                  RunStatus.NOT_RUN)}
        lines.append(f"the campaign was interrupted: {n[RunStatus.FINISHED]} run(s) finished, {n[RunStatus.STOPPED]} "
                     f"stopped where they were, {n[RunStatus.NOT_RUN]} not run")
    better, judged, unjudged = [], [], []
    for s in stats[1:]:
        # Paired: only seeds both the variant and the control finished (the seed also draws the validation
        # split, so unpaired means would compare different yardsticks). Fewer than two: no spread, no verdict.
        common = sorted(set(s["seeds"]) & set(control["seeds"]), key=str)
        s["paired_seeds"] = common
        s["beats_control"] = False
        if len(common) < 2:
            if s["finished"] or s["diverged"] < s["runs"]:
                unjudged.append(s)
            continue
        mine = [s["by_seed"][k] for k in common]
        theirs = [control["by_seed"][k] for k in common]
        diff = statistics.fmean(mine) - statistics.fmean(theirs)
        spread = max(statistics.stdev(mine), statistics.stdev(theirs))
        s["difference_vs_control"], s["paired_spread"] = diff, spread
        s["beats_control"] = diff < 0 and -diff > spread
        judged.append(s)
        if s["beats_control"]:
            better.append((diff, s, spread))
    if control["val_loss_mean"] is None:
        lines.append(f"the control ({key} = {control['variant']}) has no finished run, so nothing can be compared "
                     "to it")
    elif better:
        diff, best, spread = min(better, key=lambda b: b[0])
        lines.append(f"{key} = {best['variant']} beat the control ({control['variant']}) by {-diff:.4g} in final "
                     f"validation loss, more than the seed spread ({spread:.3g}), over {len(best['paired_seeds'])} "
                     "paired seeds")
    elif judged:
        lines.append(f"no variant beat the control ({key} = {control['variant']}) beyond seed spread")
    elif all(len(s["seeds"]) <= 1 for s in stats):
        lines.append("with one seed per variant there is no seed spread to judge differences against: "
                     "no variant is declared better than the control")
    elif unjudged:
        lines.append(f"no variant could be compared to the control ({key} = {control['variant']}): none finished "
                     "2 or more of the seeds the control finished")
    else:
        lines.append(f"no variant beat the control ({key} = {control['variant']}): every variant diverged")
    if unjudged and control["val_loss_mean"] is not None and (judged or better):
        lines.append(f"not compared (fewer than 2 seeds finished alongside the control): {key} = "
                     + ", ".join(str(s["variant"]) for s in unjudged))
    for s in stats:
        if s["diverged"]:
            where = ", ".join(f"update {x['at_update']}" for x in s["stops"] if x["status"] == RunStatus.DIVERGED)
            lines.append(f"{key} = {s['variant']} diverged in {s['diverged']} of {s['runs']} run(s) ({where}); "
                         "those runs are kept with their reason")
        if s["retries"]:
            lines.append(f"{key} = {s['variant']} includes {s['retries']} retry run(s), "
                         "each linked to the run it retried")
        if s["continued"]:
            lines.append(f"{key} = {s['variant']}: {s['continued']} seed(s) cut short by an interruption ran again "
                         "from the start (--resume), each run linked to the one it continues")
        if s["lock_drift"]:
            lines.append(f"{key} = {s['variant']}: {s['lock_drift']} run(s) ran on a drifted lock (--allow-drift) and "
                         "are left out of the comparison")
        if s["failed"] or s["not_run"]:
            lines.append(f"{key} = {s['variant']}: {s['failed']} failed or refused, {s['not_run']} stopped or not run")
    lines += [f"caveat: {c}" for c in caveats]
    return {"key": key, "control": control["variant"], "variants": stats, "text": lines,
            "metric": "final validation loss (lower is better)"}


def attempts(runs: list[dict]) -> dict[tuple, list[dict]]:
    """The runs per declared variant and seed, each pair's in planned order (declared run, then retries and
    continuations)."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault((r["meta"].get("variant_index"), json.dumps(r["meta"].get("seed"))), []).append(r)
    return out


def unanswered_failures(runs: list[dict]) -> list[dict]:
    """Per declared variant and seed, its latest failed attempt (its job raised, or its process ended without a
    result) when no later attempt of the same pair finished or diverged: a ``--retry`` that then finishes answers
    it; one that fails, is stopped or is refused does not. A diverged or stopped run is a result of the experiment
    or of a rule, not a failure of the job. ``pilotrun campaign`` exits 1 when this is not empty."""
    out = []
    for tries in attempts(runs).values():
        failed = [i for i, t in enumerate(tries) if t["status"] == RunStatus.FAILED]
        if failed and not any(t["status"] in (RunStatus.FINISHED, RunStatus.DIVERGED) for t in tries[failed[-1]:]):
            out.append(tries[failed[-1]])
    return out


def stop_text(meta: dict) -> str:
    """Where and why a run stopped, in one cell ("" for a run that finished)."""
    reason = meta.get("stop_reason")
    if not reason:
        return ""
    return f"update {meta['stopped_at']}: {reason}" if meta.get("stopped_at") else reason


def link_text(meta: dict) -> str:
    """How a run follows an earlier one ("" for a declared run)."""
    def short(run_id: str) -> str:  # "<campaign>-r05" -> "r05": the campaign is on the page already
        prefix = f"{meta.get('campaign_id')}-"
        return run_id[len(prefix):] if run_id.startswith(prefix) else run_id

    if meta.get("retry_of"):
        return f"retry of {short(meta['retry_of'])}"
    return f"continues {short(meta['continues'])} (resume)" if meta.get("continues") else ""


def table(conclusion: dict) -> list[list[str]]:
    """Rows for a terminal or HTML table."""
    out = []
    for s in conclusion["variants"]:
        mean, std = s["val_loss_mean"], s["val_loss_std"]
        spread = f" ± {std:.3g}" if std is not None else ""
        out.append([str(s["variant"]) + (" (control)" if s is conclusion["variants"][0] else ""),
                    f"{_fmt(mean)}{spread}" if mean is not None else "n/a",
                    _fmt(s["accuracy_mean"]) if s["accuracy_mean"] is not None else "",
                    f"{s['finished']}/{s['declared_seeds']}", str(s["diverged"]),
                    "" if s is conclusion["variants"][0] else "yes" if s.get("beats_control") else
                    "not compared" if len(s.get("paired_seeds") or []) < 2 and s["diverged"] < s["runs"] else "no"])
    return out

