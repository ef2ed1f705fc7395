"""One self-contained HTML file for a pilot or a campaign: tables, plots (matplotlib, embedded as PNG), the lock.

Example::

    html = render(ledger, "lr-sweep-20261129-191339-2f4a")
    Path("report.html").write_text(html)
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from ..gates.registry import job_memory_gates
from ..humanize import human_bytes, human_seconds
from ..ledger.records import RunStatus, Series
from ..ledger.store import Ledger

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;color:#1d2330;
line-height:1.45;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem}\
h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #dde2ea;padding-bottom:.2rem}
.sub{color:#5b6474}table{border-collapse:collapse;width:100%;font-size:.9rem;margin:.6rem 0}
th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #eef1f5;vertical-align:top}th{background:#f6f8fb}
.pass,.finished{color:#137333;font-weight:600}.warn,.stopped,.planned{color:#b06000;font-weight:600}
.fail,.diverged,.failed,.refused{color:#c5221f;font-weight:600}.skip,.not-run{color:#80868b}
.verdict{display:inline-block;padding:.1rem .5rem;border-radius:.3rem;background:#f1f3f4}
img{max-width:100%;border:1px solid #eef1f5;border-radius:.3rem}pre{background:#f6f8fb;padding:.8rem;overflow:auto;
font-size:.8rem;max-height:30rem}.conclusion li{margin:.3rem 0;font-weight:600}details{margin:.6rem 0}
.kv td:first-child{color:#5b6474;width:14rem}.bad{background:#fce8e6;color:#c5221f;padding:.5rem;font-weight:600}
"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _e(x) -> str:
    return html.escape(str(x)) if x is not None else ""


def _table(head: list[str], rows: list[list], raw_cols: tuple[int, ...] = ()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{c if i in raw_cols else _e(c)}</td>" for i, c in enumerate(r)) + "</tr>")
    return "".join(out) + "</table>"


def _verdict(v: str) -> str:
    return f'<span class="verdict {_e(v)}">{_e(v)}</span>'


# Says so on the page if a plot fails to decode, and leaves the count on <html> for tests that open it.
CHECK_JS = ("addEventListener('load',()=>{const i=[...document.images],ok=i.filter(x=>x.complete&&x.naturalWidth>0);"
            "document.documentElement.dataset.images=i.length;document.documentElement.dataset.imagesDecoded=ok.length;"
            "if(ok.length<i.length){const p=document.createElement('p');p.className='bad';"
            "p.textContent=(i.length-ok.length)+' plot(s) failed to render in this browser';"
            "document.body.prepend(p);}})")


def _page(title: str, subtitle: str, body: list[str]) -> str:
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><style>{CSS}</style></head>"
            f"<body><h1>{_e(title)}</h1><div class=\"sub\">{_e(subtitle)}</div>{''.join(body)}"
            "<p class=\"sub\">Written by pilotrun. Everything above comes from the ledger; nothing was left out.</p>"
            f"<script>{CHECK_JS}</script></body></html>")


# -- pilot --------------------------------------------------------------------------------------

JOB_STAGES = job_memory_gates()  # their rows measure the job's own memory (declared by each gate)


def _memory_plot(rows: list[dict], capacities: dict[str, int]) -> str:
    plt = _pyplot()
    stages = [r for r in rows if r["gate"] in JOB_STAGES and (r.get("memory") or {}).get("peak_allocated_bytes")]
    if not stages:
        return "<p class=\"sub\">No stage measured tensor memory.</p>"
    labels = [f"{r['gate']}" + (f" (rank {r['rank']})" if r.get("world_size", 1) > 1 else "") for r in stages]
    alloc = [r["memory"]["peak_allocated_bytes"] / 2**30 for r in stages]
    resv = [(r["memory"].get("peak_reserved_bytes") or 0) / 2**30 for r in stages]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(stages) + 1.6))
    y = range(len(stages))
    ax.barh([i + 0.2 for i in y], alloc, height=0.4, label="peak allocated", color="#1a73e8")
    if any(resv):
        ax.barh([i - 0.2 for i in y], resv, height=0.4, label="peak reserved", color="#8ab4f8")
    for name, cap in capacities.items():
        ax.axvline(cap / 2**30, linestyle="--", linewidth=1, color="#c5221f")
        ax.text(cap / 2**30, len(stages) - 0.4, f" {name}", rotation=90, va="top", fontsize=7, color="#c5221f")
    ax.set_xscale("log")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("GiB (log scale); dashed: capacity per device as the runtime reports it")
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def _curve(points: list[tuple[int, float]], title: str, ylabel: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", color="#1a73e8")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("update")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return _png(fig)


def _short(d: dict) -> str:
    """A lock entry in one line: nested files collapse to their folder's sha256."""
    parts = []
    for k, v in d.items():
        if isinstance(v, dict):
            v = (f"sha256 {str(v['sha256'])[:12]}…" if v.get("sha256")
                 else _short({x: y for x, y in v.items() if x != "files"}))
        elif isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
            v = v[:12] + "…"
        parts.append(f"{k}: {v}")
    return ", ".join(parts)


def _container(c: dict) -> str:
    if c.get("digest"):
        return f"{c['digest']} (from {c.get('from')})"
    return "not recorded" + (" (running inside a container: pass --container-digest)"
                             if c.get("inside_container") else "")


def _code(c: dict) -> str:
    if not c.get("commit"):
        return "not a git checkout"
    return c["commit"][:12] + (" with uncommitted changes" if c.get("dirty") else " (clean)")


def _lock_section(lock: dict | None, what: str = "") -> str:
    if not lock:
        return "<h2>Lock</h2><p class=\"sub\">No lock recorded.</p>"
    summary = [["config hash", lock.get("config_hash", "")[:16]],
               ["python / torch", f"{lock['versions'].get('python')} / {lock['versions'].get('torch')}"],
               ["CUDA / HIP / cuDNN / NCCL", " / ".join(str(lock["versions"].get(k) or "-")
                                                        for k in ("cuda", "hip", "cudnn", "nccl"))],
               ["model", _short(lock.get("model") or {})],
               ["data", f"sha256 {str(lock.get('data', {}).get('sha256', ''))[:16]} "
                        f"({lock.get('data', {}).get('source')})"],
               ["container", _container(lock.get("container") or {})],
               ["code", _code(lock.get("code") or {})]]
    return ("<h2>Lock</h2>" + (f'<p class="sub">{_e(what)}</p>' if what else "")
            + _table(["", ""], summary).replace("<table>", '<table class="kv">')
            + f"<details><summary>the whole lock.json</summary><pre>{_e(json.dumps(lock, indent=1, sort_keys=True))}"
            "</pre></details>")


def _notes(led: Ledger, run_id: str) -> str:
    notes = led.notes(run_id)
    if not notes:
        return ""
    return "<h2>Notes</h2>" + _table(["when", "note"], [[n["at"][:19].replace("T", " "), n["text"]] for n in notes])


def _attachments(folder: Path) -> str:
    """The selection sheet and the plan, when they were saved beside the run (select/plan --json > file)."""
    out = []
    for name, title in (("selection.json", "Selection sheet"), ("plan.json", "Rental plan")):
        p = folder / name
        if not p.exists():
            continue
        try:
            data = json.loads(p.read_text())
        except ValueError:
            continue
        if name == "selection.json" and isinstance(data, dict) and "rows" in data:
            rows = [[r["accelerator"], "yes" if r["fits"] else "no", f"{r['strategy']} x{r['gpus']}",
                     f"{r['micro_batch_size']} x {r['grad_accum_steps']}", human_bytes(r["device_used_bytes"]),
                     human_seconds(r.get("seconds_per_update")), r["software_stack"]["text"]] for r in data["rows"]]
            out.append(f"<h2>{title}</h2>" + _table(["accelerator", "fits", "strategy", "mb x accum", "used",
                                                     "time/update", "stack"], rows))
        elif name == "plan.json" and isinstance(data, dict) and "accelerators" in data:
            rows = []
            for a in data["accelerators"]:
                for p_ in a.get("plans", []):
                    rows.append([a["accelerator"], p_["days"], p_["gpus"], "yes" if p_["fits_with_margin"] else "no",
                                 p_["runs_that_fit"], "; ".join(p_["advice"])])
            out.append(f"<h2>{title}</h2>" + _table(["accelerator", "days", "GPUs", "fits", "runs", "advice"], rows))
    return "".join(out)


def render_pilot(led: Ledger, run: dict) -> str:
    from ..estimate.catalog import load_catalog

    rows = led.gate_rows(run["run_id"])
    body = ["<h2>Gates</h2>"]
    table_rows = []
    for r in rows:
        mem = r.get("memory") or {}
        table_rows.append([r["gate"] + (f" · rank {r['rank']}" if r.get("world_size", 1) > 1 else ""),
                           _verdict(r["verdict"]), human_seconds(r.get("seconds")) if r.get("seconds") else "",
                           human_bytes(mem.get("peak_allocated_bytes")) if mem.get("peak_allocated_bytes") else "",
                           human_bytes(mem.get("peak_reserved_bytes")) if mem.get("peak_reserved_bytes") else "",
                           human_bytes(mem.get("host_rss_peak_bytes")) if mem.get("host_rss_peak_bytes") else "",
                           _e(r["reason"])])
    body.append(_table(["gate", "verdict", "time", "peak alloc", "peak reserved", "host RSS", "reason"], table_rows,
                       raw_cols=(1, 6)))
    caps = {a.name: a.memory_bytes for a in load_catalog().values()}
    body.append("<h2>Memory per stage against each accelerator</h2>" + _memory_plot(rows, caps))
    share = []
    for r in rows:
        peak = (r.get("memory") or {}).get("peak_allocated_bytes")
        if r["gate"] in JOB_STAGES and peak:
            share.append([r["gate"], human_bytes(peak)] + [f"{peak / c:.2%}" for c in caps.values()])
    if share:
        body.append(_table(["stage", "peak"] + [f"of {n}" for n in caps], share))
    metrics = led.metrics(run["run_id"])
    # A pilot's per-update points are its updates (first_step, steady_step): rank 0's curve.
    train = [(m["step"], m["loss"]) for m in metrics if m["rank"] == 0 and m["loss"] is not None]
    if train:
        body.append("<h2>Updates</h2>" + _curve(train, "training loss per update (the pilot's updates)", "loss"))
    overfit = next((r for r in rows if r["gate"] == "overfit" and r["details"].get("losses")), None)
    if overfit:
        body.append(_curve(list(enumerate(overfit["details"]["losses"], 1)), "overfit: loss on the tiny subset",
                           "loss"))
    body.append(_attachments(Path(run["out_dir"] or ".")))
    body.append(_lock_section(json.loads(run["lock_json"]) if run.get("lock_json") else None))
    body.append(_notes(led, run["run_id"]))
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in ("pass", "warn", "fail", "skip")}
    sub = (f"pilot {run['run_id']} · {run['status']} · {counts['pass']} passed, {counts['warn']} warned, "
           f"{counts['fail']} failed, {counts['skip']} skipped · started {run['started_at'][:19].replace('T', ' ')}")
    return _page(f"Pilot: {run['name']}", sub, body)


# -- campaign -----------------------------------------------------------------------------------

def _value(m: dict, field: str) -> float | None:
    if field == "throughput":
        # tokens/s for sequence models, examples/s otherwise: whichever the worker counted.
        n = m.get("tokens") or m.get("examples")
        return n / m["seconds"] if n and m.get("seconds") else None
    return m.get(field)


def _run_style(runs: list[dict], key: str, plt):
    """One colour per variant, one line style per seed: the same run looks the same in every plot."""
    order = [str(x["meta"].get("variant")) for x in runs]
    variants = sorted(set(order), key=order.index)
    seeds = sorted({r["meta"].get("seed") for r in runs}, key=str)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]

    def style(r: dict) -> dict:
        v = str(r["meta"].get("variant"))
        label = f"{key}={v}, seed {r['meta'].get('seed')}"
        if r.get("parent_id"):
            label += " (resumed)" if r["meta"].get("continues") else " (retry)"
        if r["status"] != "finished":
            label += f" ({r['status']})"
        seed = r["meta"].get("seed")
        return {"color": colors[variants.index(v) % len(colors)], "label": label,
                "linestyle": styles[seeds.index(seed) % len(styles)] if seed in seeds else "-"}
    return style


def _plain_log_axis(ax) -> None:
    """Log scale with 2, 3, 5, 10 on the axis instead of 2 x 10^0: loss values people can read off."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    # Within a decade every integer multiple is a useful tick; across several, 1-2-5 stays legible.
    ax.yaxis.set_major_locator(LogLocator(subs=tuple(range(1, 10)) if hi / lo < 12 else (1.0, 2.0, 5.0)))
    plain = ScalarFormatter()
    plain.set_scientific(False)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())


def _campaign_curves(led: Ledger, runs: list[dict], key: str, series: Series, title: str) -> str:
    plt = _pyplot()
    style = _run_style(runs, key, plt)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    drawn = 0
    for r in runs:
        pts = [(m["step"], m["loss"]) for m in led.metrics(r["run_id"], series) if m["loss"] is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if series == Series.VAL else None, alpha=0.9,
                **style(r))
        # Mark where a run diverged on its training curve (its last validation point is not where it diverged).
        if r["status"] == RunStatus.DIVERGED and series == Series.TRAIN:
            ax.plot([pts[-1][0]], [pts[-1][1]], marker="x", markersize=10, color="#c5221f")
        drawn += 1
    if not drawn:
        plt.close(fig)
        return "<p class=\"sub\">No points recorded.</p>"
    _plain_log_axis(ax)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("update")
    ax.set_ylabel("loss (log scale)")
    ax.grid(alpha=0.3)
    # Below the axes: inside, it hides exactly the diverging curves people need to see.
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    return _png(fig)


def _campaign_dynamics(led: Ledger, runs: list[dict], key: str) -> str:
    """Learning rate, gradient norm and throughput per update: what was kept besides the loss."""
    plt = _pyplot()
    style = _run_style(runs, key, plt)
    panels = (("lr", "learning rate (log scale)", True), ("grad_norm", "gradient norm (log scale)", True),
              ("throughput", "throughput (tokens or examples / s)", False))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    drawn = 0
    for r in runs:
        metrics = led.metrics(r["run_id"], Series.TRAIN)
        for ax, (field, _, _) in zip(axes, panels):
            pts = [(m["step"], v) for m in metrics if (v := _value(m, field)) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], alpha=0.85, linewidth=1.2, **style(r))
                drawn += 1
    if not drawn:
        plt.close(fig)
        return "<p class=\"sub\">No learning rate, gradient norm or throughput recorded.</p>"
    for ax, (_, title, log) in zip(axes, panels):
        if log and ax.has_data():
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False)
    fig.tight_layout()
    return _png(fig)


def render_campaign(led: Ledger, camp: dict) -> str:
    from ..campaign.conclude import conclude, link_text, stop_text, table
    from ..ledger.records import final_val_loss

    meta = json.loads(camp["meta_json"] or "{}")
    runs = led.campaign_runs(camp["run_id"])
    key = meta.get("key", "")
    conclusion = conclude(key, meta.get("values", []), runs, interrupted=camp["status"] == "interrupted",
                          caveats=(meta.get("parallel") or {}).get("warnings", []))
    body = ["<h2>Conclusion</h2><ul class=\"conclusion\">" + "".join(f"<li>{_e(t)}</li>" for t in conclusion["text"])
            + "</ul>", _table([key, "final val loss, mean ± spread", "accuracy", "finished", "diverged",
                               "beats control"], table(conclusion)),
            f"<p class=\"sub\">{_e(conclusion['metric'])}; a variant beats the control only by more than the larger "
            "seed spread. Declared before the start: " + _e(json.dumps(meta.get("campaign", {}).get("stop"))) + "</p>"]
    rows = []
    for r in runs:
        m = r["meta"]
        final = final_val_loss(r["status"], m)
        rows.append([r["run_id"], m.get("variant"), m.get("seed"),
                     f'<span class="{_e(r["status"])}">{_e(r["status"])}</span>',
                     stop_text(m),
                     f"{final:.4g}" if final is not None else "",
                     link_text(m), json.dumps(m.get("changes")) if m.get("changes") else ""])
    body.append("<h2>Every run</h2>" + _table(["run", key, "seed", "status", "stopped", "final val loss", "follows",
                                               "changed"], rows, raw_cols=(3,)))
    body.append("<h2>Training loss</h2>" + _campaign_curves(led, runs, key, Series.TRAIN,
                                                           "training loss per update (x: where a run diverged)"))
    body.append("<h2>Validation</h2>" + _campaign_curves(led, runs, key, Series.VAL, "validation loss"))
    body.append("<h2>Learning rate, gradient norm, throughput</h2>" + _campaign_dynamics(led, runs, key))
    body.append(_attachments(Path(camp["out_dir"] or ".")))
    body.append(_lock_section(json.loads(camp["lock_json"]) if camp.get("lock_json") else None,
                              "taken from the control's first run at the start; each run's own lock is "
                              "checked against it before the run starts"))
    body.append(_notes(led, camp["run_id"]))
    sub = (f"campaign {camp['run_id']} · {camp['status']} · {len(runs)} runs · {key} over {meta.get('values')} × seeds "
           f"{meta.get('seeds')} · {meta.get('campaign', {}).get('updates')} updates each"
           + (f" · {meta['parallel']['text']}" if meta.get("parallel") else ""))
    return _page(f"Campaign: {camp['name']}", sub, body)


def render_campaign_run(led: Ledger, run: dict) -> str:
    """One run of a campaign: what it varied, where it stopped, its curves; the campaign has the comparison."""
    from ..campaign.conclude import link_text, stop_text
    from ..ledger.records import final_val_loss

    meta = json.loads(run["meta_json"] or "{}")
    r = {**run, "meta": meta}
    key = meta.get("key", "")
    final = final_val_loss(run["status"], meta)
    facts = [["campaign", meta.get("campaign_id")], [key, json.dumps(meta.get("variant"))
                                                     + (" (control)" if meta.get("control") else "")],
             ["seed", meta.get("seed")], ["status", f'<span class="{_e(run["status"])}">{_e(run["status"])}</span>'],
             ["stopped", _e(stop_text(meta))],
             ["final validation loss", f"{final:.4g}" if final is not None else ""],
             ["follows", _e(link_text(meta))], ["changed", _e(json.dumps(meta.get("changes") or {}))]]
    if meta.get("lock_drift"):
        facts.append(["lock drift", _e(", ".join(meta["lock_drift"]))])
    body = ["<h2>Run</h2>" + _table(["", ""], [[_e(a), b] for a, b in facts], raw_cols=(0, 1))
            .replace("<table>", '<table class="kv">'),
            f"<p class=\"sub\">Compared with the other runs in <code>pilotrun report {_e(meta.get('campaign_id'))}"
            "</code>.</p>",
            "<h2>Training loss</h2>" + _campaign_curves(led, [r], key, Series.TRAIN, "training loss per update"),
            "<h2>Validation</h2>" + _campaign_curves(led, [r], key, Series.VAL, "validation loss"),
            "<h2>Learning rate, gradient norm, throughput</h2>" + _campaign_dynamics(led, [r], key),
            _lock_section(json.loads(run["lock_json"]) if run.get("lock_json") else None), _notes(led, run["run_id"])]
    return _page(f"Campaign run: {run['run_id']}", f"{key} = {json.dumps(meta.get('variant'))} · seed "
                 f"{meta.get('seed')} · {run['status']}", body)


def render(led: Ledger, ref: str) -> tuple[str, dict]:
    run = led.run(ref)
    if run is None:
        raise KeyError(ref)
    if run["kind"] == "campaign":
        return render_campaign(led, run), run
    if run["kind"] == "campaign-run":
        return render_campaign_run(led, run), run
    return render_pilot(led, run), run
