"""One self-contained HTML file for a pilot or a campaign: tables, plots (matplotlib, embedded as PNG), the lock.

Example::

    html = render(ledger, "lr-sweep-20261129-191339-2f4a")
    Path("report.html").write_text(html)
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
from collections.abc import Sequence
from pathlib import Path

from ..estimate.experiments import adapter_line
from ..gates.registry import job_memory_gates
from ..humanize import human_bytes, human_seconds, money
from ..ledger.details import LoadDetails, OverfitDetails
from ..ledger.records import GateName, GateRow, Series
from ..ledger.store import Ledger
from ..safefile import FileKind, FileProblem, NonNegative, Optional, read_json
from .plots import campaign_figure, curve_figure, dynamics_figure, inline_svg, is_retry, memory_figure, png

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
.plot svg{display:block}
"""


class Html(str):
    """Markup the report wrote itself: the one kind of text the page takes as it is.

    Every value from the ledger, a spec, a lock or a file (names, ids, values, reasons, notes, paths) is text and
    reaches the page only through :func:`_e`; :func:`_h` fills a literal template with escaped values, and
    :func:`_table` and :func:`_page` escape whatever they are handed that is not ``Html``. A value forgotten on the
    way shows as visible markup, never as markup the browser runs."""
    __slots__ = ()

    def __add__(self, other: str) -> Html:
        return Html(str.__add__(self, _e(other)))


def _e(x) -> Html:
    """The one escaping path (quotes included, so a value is safe in an attribute too)."""
    if isinstance(x, Html):
        return x
    return Html(html.escape(str(x), quote=True) if x is not None else "")


def _h(template: str, *values) -> Html:
    """A literal ``template`` whose ``{}`` are filled with ``values``, each escaped unless it is ``Html``."""
    return Html(template.format(*(_e(v) for v in values)))


def _join(parts) -> Html:
    return Html("".join(_e(p) for p in parts))


def _plot(markup: str) -> Html:
    """A plot from plots.py: a PNG as base64 in a data: URI, or matplotlib's SVG (its writer escapes every text and
    attribute it draws, and plots.inline_svg escapes the label it adds). Trusted as markup for that reason only."""
    return Html(markup)


def _table(head: list[str], rows: list[list], cls: str = "") -> Html:
    out = [_h("<table{}><tr>", _h(' class="{}"', cls) if cls else ""), *(_h("<th>{}</th>", h) for h in head),
           Html("</tr>")]
    for r in rows:
        out.append(_h("<tr>{}</tr>", _join(_h("<td>{}</td>", c) for c in r)))
    return _join(out + [Html("</table>")])


def _verdict(v: str) -> Html:
    return _h('<span class="verdict {}">{}</span>', v, v)


def _status(status: str) -> Html:
    return _h('<span class="{}">{}</span>', status, status)


# Says so on the page if a plot fails to decode, and leaves the count on <html> for tests that open it.
CHECK_JS = ("addEventListener('load',()=>{const i=[...document.images],ok=i.filter(x=>x.complete&&x.naturalWidth>0);"
            "document.documentElement.dataset.images=i.length;document.documentElement.dataset.imagesDecoded=ok.length;"
            "if(ok.length<i.length){const p=document.createElement('p');p.className='bad';"
            "p.textContent=(i.length-ok.length)+' plot(s) failed to render in this browser';"
            "document.body.prepend(p);}})")


def script_hash(js: str) -> str:
    """A CSP source that allows exactly this inline script's text."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(js.encode()).digest()).decode() + "'"


# The page runs CHECK_JS and nothing else: no other inline script, no event handler attribute, nothing fetched (the
# plots are data: images and inline SVG). A value that got past the escaping would still run nothing. Styles stay
# inline (the stylesheet and matplotlib's SVG attributes): with nothing fetched they cannot send anything anywhere.
CSP = ("default-src 'none'; script-src " + script_hash(CHECK_JS) + "; style-src 'unsafe-inline'; img-src data:; "
       "base-uri 'none'; form-action 'none'")


def _page(title: str, subtitle: str, body: list[Html]) -> str:
    # The policy comes first in <head>: it holds only for what the parser meets after it.
    return _h("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
              "<meta http-equiv=\"Content-Security-Policy\" content=\"{}\"><title>{}</title>"
              "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><style>{}</style></head>"
              "<body><h1>{}</h1><div class=\"sub\">{}</div>{}"
              "<p class=\"sub\">Written by pilotrun. Everything above comes from the ledger; nothing was left out.</p>"
              "<script>{}</script></body></html>", CSP, title, Html(CSS), title, subtitle, _join(body), Html(CHECK_JS))


# -- pilot --------------------------------------------------------------------------------------

JOB_STAGES = job_memory_gates()  # their rows measure the job's own memory (declared by each gate)


def _memory_plot(rows: Sequence[GateRow], capacities: dict[str, int]) -> Html:
    stages = [r for r in rows if r.gate in JOB_STAGES and r.memory.get("peak_allocated_bytes")]
    if not stages:
        return Html("<p class=\"sub\">No stage measured tensor memory.</p>")
    return _plot(inline_svg(memory_figure(stages, capacities),
                            "peak memory per stage against each accelerator's capacity"))


def _curve(points: list[tuple[int, float]], title: str, ylabel: str) -> Html:
    return _plot(png(curve_figure(points, title, ylabel)))


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
    if c.get("inside_container"):
        return "not known: inside a container that does not expose its image digest (pass --container-digest)"
    return "none: not in a container"


def _code(c: dict) -> str:
    if not c.get("commit"):
        return "not a git checkout"
    return c["commit"][:12] + (" with uncommitted changes" if c.get("dirty") else " (clean)")


def _lock_section(lock: dict | None, what: str = "") -> Html:
    if not lock:
        return Html("<h2>Lock</h2><p class=\"sub\">No lock recorded.</p>")
    summary = [["config hash", lock.get("config_hash", "")[:16]],
               ["python / torch", f"{lock['versions'].get('python')} / {lock['versions'].get('torch')}"],
               ["CUDA / HIP / cuDNN / NCCL", " / ".join(str(lock["versions"].get(k) or "-")
                                                        for k in ("cuda", "hip", "cudnn", "nccl"))],
               ["model", _short(lock.get("model") or {})],
               ["data", f"sha256 {str(lock.get('data', {}).get('sha256', ''))[:16]} "
                        f"({lock.get('data', {}).get('source')})"],
               ["container", _container(lock.get("container") or {})],
               ["code", _code(lock.get("code") or {})]]
    return _h("<h2>Lock</h2>{}{}<details><summary>the whole lock.json</summary><pre>{}</pre></details>",
              _h('<p class="sub">{}</p>', what) if what else "", _table(["", ""], summary, cls="kv"),
              json.dumps(lock, indent=1, sort_keys=True))


def _notes(led: Ledger, run_id: str) -> Html:
    notes = led.notes(run_id)
    if not notes:
        return Html("")
    return Html("<h2>Notes</h2>") + _table(["when", "note"],
                                           [[n["at"][:19].replace("T", " "), n["text"]] for n in notes])


_NUMBER = NonNegative()
_ADAPTER = Optional({"label": str, "trainable_parameters": _NUMBER, "parameters": _NUMBER, "trainable_share": _NUMBER,
                     "adapter_bytes": _NUMBER, "frozen_base_bytes": _NUMBER, "quantized_layers": _NUMBER,
                     "checkpoint_bytes": _NUMBER})
# What the report reads of `select --json` / `plan --json` output saved beside the run: a file of another shape is
# said in the report and left out (a KeyError here once read as "no run ... in ledger").
ATTACHMENTS = {
    "selection.json": ("Selection sheet", {"rows": [{
        "accelerator": str, "fits": bool, "strategy": str, "gpus": _NUMBER, "micro_batch_size": _NUMBER,
        "grad_accum_steps": _NUMBER, "device_used_bytes": _NUMBER, "seconds_per_update": Optional(_NUMBER),
        "cost_per_update": Optional(_NUMBER), "cost_for_planned_updates": Optional(_NUMBER),
        "software_stack": {"text": str}, "experiment": Optional(str), "adapter": _ADAPTER}]}),
    "plan.json": ("Rental plan", {"accelerators": [{"accelerator": str, "plans": Optional([{
        "days": _NUMBER, "gpus": _NUMBER, "fits_with_margin": bool, "runs_that_fit": _NUMBER,
        "cost": Optional(_NUMBER), "advice": [str]}])}]}),
}
ATTACHMENT_CAP = 16 << 20


def _attachments(folder: Path) -> Html:
    """The selection sheet and the plan, when they were saved beside the run (select/plan --json > file)."""
    out = []
    for name, (title, schema) in ATTACHMENTS.items():
        try:
            data = read_json(folder / name, ATTACHMENT_CAP, schema, links=True)
        except FileProblem as exc:
            if exc.kind != FileKind.MISSING:
                out.append(_h("<h2>{}</h2><p>{}: left out of the report (save `pilotrun {} ... --json` output there)"
                              "</p>", title, str(exc), "select" if name == "selection.json" else "plan"))
            continue
        if name == "selection.json":
            out.append(_selection(title, data))
        else:
            rows = []
            for a in data["accelerators"]:
                for p_ in a.get("plans") or []:
                    rows.append([a["accelerator"], p_["days"], p_["gpus"], "yes" if p_["fits_with_margin"] else "no",
                                 p_["runs_that_fit"], money(p_.get("cost")), "; ".join(p_["advice"])])
            out.append(_h("<h2>{}</h2>{}", title, _table(["accelerator", "days", "GPUs", "fits", "runs",
                                                          "rental cost", "advice"], rows)))
    return _join(out)


def _selection(title: str, data: dict) -> Html:
    rows = [[r.get("experiment") or "", r["accelerator"], "yes" if r["fits"] else "no", f"{r['strategy']} x{r['gpus']}",
             f"{r['micro_batch_size']} x {r['grad_accum_steps']}", human_bytes(r["device_used_bytes"]),
             human_seconds(r.get("seconds_per_update")), money(r.get("cost_per_update")),
             money(r.get("cost_for_planned_updates")), r["software_stack"]["text"]] for r in data["rows"]]
    out = [_h("<h2>{}</h2>{}", title, _table(["experiment", "accelerator", "fits", "strategy", "mb x accum", "used",
                                              "time/update", "cost/update", "cost for the updates", "stack"], rows))]
    adapters = dict.fromkeys(_adapter_line(r["adapter"]) for r in data["rows"] if r.get("adapter"))
    return _join(out + [_h("<p>{}</p>", line) for line in adapters if line])


def _adapter_line(view: dict) -> str:
    try:  # its quantised and merged parts are read only when present: the schema cannot say "when"
        return adapter_line(view)
    except (KeyError, TypeError, ValueError):
        return "the adapter's line is left out: selection.json's 'adapter' is not select --json's"


def _adapter_section(rows: Sequence[GateRow]) -> Html:
    """Trainable vs frozen parameters as the load gate measured them, and the export's artifacts, when only part
    of the model trains (an adapter): the share trained, its size, and the merged export's size and time."""
    load = next((r for r in rows if r.gate == GateName.LOAD and r.details), None)
    d = LoadDetails.of(load.details if load is not None else None)
    total, trainable = d.parameters, d.trainable_parameters
    if not total or trainable is None or trainable >= total:
        return Html("")
    items = [["trainable parameters", f"{trainable:,} of {total:,} ({trainable / total:.2%})"]]
    for size, name in ((d.trainable_bytes, "adapter size"), (d.frozen_bytes, "frozen base")):
        if size is not None:
            items.append([name, human_bytes(size)])
    # The export gate's row says what it wrote: the PEFT adapter and, with export.merge, the merged model (or why
    # not), with its time.
    export = next((r for r in rows if r.gate == GateName.EXPORT), None)
    if export is not None:
        items.append(["export", f"{export.verdict}: {export.reason}"
                      + (f" ({human_seconds(export.seconds)})" if export.seconds else "")])
    return Html("<h2>Adapter</h2>") + _table(["", ""], items)


def render_pilot(led: Ledger, run: dict) -> str:
    from ..estimate.catalog import load_catalog

    rows = led.gate_records(run["run_id"])
    body = [Html("<h2>Gates</h2>")]
    table_rows = []
    for r in rows:
        mem = r.memory
        table_rows.append([r.gate + (f" · rank {r.rank}" if r.world_size > 1 else ""),
                           _verdict(r.verdict), human_seconds(r.seconds) if r.seconds else "",
                           human_bytes(mem.get("peak_allocated_bytes")) if mem.get("peak_allocated_bytes") else "",
                           human_bytes(mem.get("peak_reserved_bytes")) if mem.get("peak_reserved_bytes") else "",
                           human_bytes(mem.get("host_rss_peak_bytes")) if mem.get("host_rss_peak_bytes") else "",
                           r.reason or str(r.verdict)])
    body.append(_table(["gate", "verdict", "time", "peak alloc", "peak reserved", "host RSS", "reason"], table_rows))
    body.append(_adapter_section(rows))
    caps = {a.name: a.memory_bytes for a in load_catalog().values()}
    body.append(Html("<h2>Memory per stage against each accelerator</h2>") + _memory_plot(rows, caps))
    share = []
    for r in rows:
        peak = r.memory.get("peak_allocated_bytes")
        if r.gate in JOB_STAGES and peak:
            share.append([r.gate, human_bytes(peak)] + [f"{peak / c:.2%}" for c in caps.values()])
    if share:
        body.append(_table(["stage", "peak"] + [f"of {n}" for n in caps], share))
    metrics = led.metrics(run["run_id"])
    # A pilot's per-update points are its updates (first_step, steady_step): rank 0's curve.
    train = [(m["step"], m["loss"]) for m in metrics if m["rank"] == 0 and m["loss"] is not None]
    if train:
        body.append(Html("<h2>Updates</h2>") + _curve(train, "training loss per update (the pilot's updates)", "loss"))
    overfit = next((losses for r in rows
                    if r.gate == GateName.OVERFIT and (losses := OverfitDetails.of(r.details).losses)), None)
    if overfit:
        body.append(_curve(list(enumerate(overfit, 1)), "overfit: loss on the tiny subset", "loss"))
    body.append(_attachments(Path(run["out_dir"] or ".")))
    body.append(_lock_section(json.loads(run["lock_json"]) if run.get("lock_json") else None))
    body.append(_notes(led, run["run_id"]))
    counts = {v: sum(1 for r in rows if r.verdict == v) for v in ("pass", "warn", "fail", "skip")}
    sub = (f"pilot {run['run_id']} · {run['status']} · {counts['pass']} passed, {counts['warn']} warned, "
           f"{counts['fail']} failed, {counts['skip']} skipped · started {run['started_at'][:19].replace('T', ' ')}")
    return _page(f"Pilot: {run['name']}", sub, body)


# -- campaign -----------------------------------------------------------------------------------

def _campaign_curves(led: Ledger, runs: list[dict], key: str, series: Series, title: str) -> Html:
    fig = campaign_figure(led, runs, key, series, title)
    if fig is None:
        return Html("<p class=\"sub\">No points recorded.</p>")
    retried = [r for r in runs if is_retry(r)]
    caption = Html("<p class=\"sub\">Dashed, darker: a retry; its legend entry names the run it retried.</p>"
                   if retried else "")
    return _plot(png(fig)) + caption


def _campaign_dynamics(led: Ledger, runs: list[dict], key: str) -> Html:
    """Learning rate, gradient norm and throughput per update: what was kept besides the loss."""
    fig = dynamics_figure(led, runs, key)
    if fig is None:
        return Html("<p class=\"sub\">No learning rate, gradient norm or throughput recorded.</p>")
    return _plot(png(fig))


def render_campaign(led: Ledger, camp: dict) -> str:
    from ..campaign.conclude import conclude, link_text, stop_text, table
    from ..ledger.records import final_val_loss

    meta = json.loads(camp["meta_json"] or "{}")
    runs = led.campaign_runs(camp["run_id"])
    key = meta.get("key", "")
    conclusion = conclude(key, meta.get("values", []), runs, interrupted=camp["status"] == "interrupted",
                          caveats=(meta.get("parallel") or {}).get("warnings", []))
    body = [_h("<h2>Conclusion</h2><ul class=\"conclusion\">{}</ul>", _join(_h("<li>{}</li>", t)
                                                                        for t in conclusion["text"])),
            _table([key, "final val loss, mean ± spread", "accuracy", "finished", "diverged", "beats control"],
                   table(conclusion)),
            _h("<p class=\"sub\">{}; a variant beats the control only by more than the larger seed spread. Declared "
               "before the start: {}</p>", conclusion["metric"], json.dumps(meta.get("campaign", {}).get("stop")))]
    rows = []
    for r in runs:
        m = r["meta"]
        final = final_val_loss(r["status"], m)
        rows.append([r["run_id"], m.get("variant"), m.get("seed"), _status(r["status"]), stop_text(m),
                     f"{final:.4g}" if final is not None else "",
                     link_text(m), json.dumps(m.get("changes")) if m.get("changes") else ""])
    body.append(Html("<h2>Every run</h2>") + _table(["run", key, "seed", "status", "stopped", "final val loss",
                                                     "follows", "changed"], rows))
    body.append(Html("<h2>Training loss</h2>") + _campaign_curves(
        led, runs, key, Series.TRAIN, "training loss per update (x: where a run diverged)"))
    body.append(Html("<h2>Validation</h2>") + _campaign_curves(led, runs, key, Series.VAL, "validation loss"))
    body.append(Html("<h2>Learning rate, gradient norm, throughput</h2>") + _campaign_dynamics(led, runs, key))
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
    facts = [["campaign", meta.get("campaign_id")],
             [key, json.dumps(meta.get("variant")) + (" (control)" if meta.get("control") else "")],
             ["seed", meta.get("seed")], ["status", _status(run["status"])], ["stopped", stop_text(meta)],
             ["final validation loss", f"{final:.4g}" if final is not None else ""],
             ["follows", link_text(meta)], ["changed", json.dumps(meta.get("changes") or {})]]
    if meta.get("lock_drift"):
        facts.append(["lock drift", ", ".join(map(str, meta["lock_drift"]))])
    body = [Html("<h2>Run</h2>") + _table(["", ""], facts, cls="kv"),
            _h("<p class=\"sub\">Compared with the other runs in <code>pilotrun report {}</code>.</p>",
               meta.get("campaign_id")),
            Html("<h2>Training loss</h2>") + _campaign_curves(led, [r], key, Series.TRAIN, "training loss per update"),
            Html("<h2>Validation</h2>") + _campaign_curves(led, [r], key, Series.VAL, "validation loss"),
            Html("<h2>Learning rate, gradient norm, throughput</h2>") + _campaign_dynamics(led, [r], key),
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
