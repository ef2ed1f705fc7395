"""The HTML report's plots: capacity labels that do not overlap (measured in real headless Chromium), retries drawn
apart from the run they retried, and a labelled tick where diverged points sit."""
from __future__ import annotations

import json
import math
from itertools import combinations

import pytest

from pilotrun.estimate.catalog import load_catalog
from pilotrun.ledger.records import RunEnd, RunKind, RunStatus, Series, StopKind
from pilotrun.ledger.store import Ledger
from pilotrun.report.html import script_hash
from pilotrun.report.plots import MAX_INNER_GAP, MAX_UNLABELLED, RETRY_DASH, campaign_figure, log_ticks
from tests.conftest import copy_example, gate_rows, open_in_chromium, pilotrun_cli

# Run in the page after load: the browser's own boxes of the capacity labels, left on <html> for --dump-dom. The
# report's Content-Security-Policy runs only the scripts it names by hash: the test adds this one's to its copy.
MEASURE_JS = ("addEventListener('load',()=>{const b=[...document.querySelectorAll('[id^=\"capacity-label-\"]')]"
              ".map(g=>{const t=g.querySelector('text'),r=t.getBoundingClientRect();return {id:g.id,text:t.textContent,"
              "left:r.left,right:r.right,top:r.top,bottom:r.bottom}});"
              "document.documentElement.dataset.labelBoxes=JSON.stringify(b);})")


@pytest.mark.process
@pytest.mark.browser
def test_capacity_labels_do_not_overlap_in_a_real_browser(tmp_path, monkeypatch):
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", "sha256:" + "5e" * 32)
    gate_rows(copy_example("tiny-sft", tmp_path), tmp_path, gates=["first_step"])  # real rows with real memory
    html = tmp_path / "pilot.html"
    with Ledger(tmp_path / "l.sqlite") as led:
        run_id = led.runs()[0]["run_id"]
    res = pilotrun_cli("report", run_id, "--ledger", str(tmp_path / "l.sqlite"), "--out", str(html), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    measured = tmp_path / "measured.html"
    page = html.read_text()
    assert page.count("script-src ") == 1
    measured.write_text(page.replace("script-src ", f"script-src {script_hash(MEASURE_JS)} ")
                        .replace("</body>", f"<script>{MEASURE_JS}</script></body>"))
    dom, console, shot = open_in_chromium(measured, tmp_path)
    assert not [c for c in console if "Uncaught" in c], console
    boxes = json.loads(dom.split('data-label-boxes="')[1].split('"')[0].replace("&quot;", '"'))
    catalog = load_catalog()
    # Every accelerator has its own label (A100 and H100 are both ~79 GiB: one line, two labels).
    assert sorted(b["text"].split(":")[0] for b in boxes) == sorted(a.name for a in catalog.values())
    for a, b in combinations(boxes, 2):
        apart = a["right"] <= b["left"] or b["right"] <= a["left"] or a["bottom"] <= b["top"] or b["bottom"] <= a["top"]
        assert apart, f"{a['text']!r} overlaps {b['text']!r} in the browser: {a} {b}"
    assert all(b["right"] - b["left"] > 20 and b["bottom"] - b["top"] > 4 for b in boxes), boxes  # drawn, legible
    assert shot.exists()


@pytest.mark.parametrize("lo, hi", [(4.57, 13.33), (4.6, 27.0), (2.0, 2000.0), (0.01, 1e6), (0.3, 7.0)])
def test_log_ticks_leave_no_long_unlabelled_stretch(lo, hi):
    ticks = log_ticks(lo, hi)
    assert 2 <= len(ticks) <= 12 and all(lo <= t <= hi for t in ticks), ticks
    span = math.log10(hi / lo)
    assert max(math.log10(ticks[0] / lo), math.log10(hi / ticks[-1])) <= MAX_UNLABELLED * span + 1e-9, ticks
    assert max(math.log10(b / a) for a, b in zip(ticks, ticks[1:])) <= MAX_INNER_GAP * span + 1e-9, ticks


@pytest.mark.parametrize("lo, hi, expected", [(11.5, 14.2, [12.0, 13.0, 14.0]), (0.5, 0.52, [0.5, 0.51, 0.52]),
                                              (1.0, 1.001, [1.0, 1.0005, 1.001])])
def test_narrow_ranges_get_the_finest_ticks_there_are(lo, hi, expected):
    assert log_ticks(lo, hi) == expected


def _campaign(path) -> tuple[Ledger, list[dict]]:
    """A real ledger: a control, a run that diverged to a high validation loss, and its retry with a smaller batch."""
    led = Ledger(path)
    cid = "sweep-20261201-000000-abcd"
    val = {"r01": [5.6, 4.8], "r02": [9.1, 13.3], "r03": [9.4, 12.9]}
    for run, parent, variant, changes in [("r01", None, 0.003, None), ("r02", None, 1.0, None),
                                          ("r03", "r02", 1.0, {"train.micro_batch_size": 4})]:
        meta = {"campaign_id": cid, "variant": variant, "seed": 1, "key": "train.optimizer.lr"}
        if changes:
            meta["changes"] = changes
        led.start_run(f"{cid}-{run}", "sweep", RunKind.CAMPAIGN_RUN, parent_id=f"{cid}-{parent}" if parent else None,
                      meta=meta)
        led.add_metrics(f"{cid}-{run}", Series.VAL, [{"step": 6 * (i + 1), "loss": v} for i, v in enumerate(val[run])])
        status = RunStatus.DIVERGED if run == "r02" else RunStatus.FINISHED
        led.finish_campaign_run(f"{cid}-{run}", RunEnd(status, StopKind.BUDGET, "test", 12))
    return led, led.campaign_runs(cid)


def test_a_retry_is_drawn_apart_and_names_the_run_it_retried(tmp_path):
    led, runs = _campaign(tmp_path / "c.sqlite")
    with led:
        fig = campaign_figure(led, runs, "train.optimizer.lr", Series.VAL, "validation loss")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    retry = next(line for label, line in lines.items() if "retry of r02" in label)
    parent = next(line for label, line in lines.items() if label.startswith("r02 "))
    assert "micro_batch_size 4" in retry.get_label()
    assert retry.get_linestyle() != parent.get_linestyle() and retry.get_color() != parent.get_color()
    assert retry.get_linewidth() > parent.get_linewidth()
    assert all(line.get_linestyle() != retry.get_linestyle() for line in lines.values() if line is not retry)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("retry of r02" in t for t in legend)
    assert retry.get_linestyle() == "--" and RETRY_DASH[0] == 0  # matplotlib reports any custom dash as "--"


def test_the_validation_plot_labels_where_diverged_points_sit(tmp_path):
    led, runs = _campaign(tmp_path / "c.sqlite")
    with led:
        fig = campaign_figure(led, runs, "train.optimizer.lr", Series.VAL, "validation loss")
    ax = fig.axes[0]
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    labelled = [t.get_position()[1] for t in ax.get_yticklabels() if t.get_text()
                and lo <= t.get_position()[1] <= hi]
    top = max(labelled)
    # The diverged run and its retry sit at 12.9-13.3: a labelled tick within the top fifth of the (log) axis.
    assert math.log10(hi / top) <= 0.2 * math.log10(hi / lo), (labelled, lo, hi)
    assert any(t >= 12 for t in labelled), labelled
