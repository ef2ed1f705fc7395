"""The HTML report with hostile values in every field it shows (names, ids, campaign values, seeds, gate reasons,
notes, the lock, a saved selection sheet): they appear only as escaped text, and opened in real headless Chromium
the page runs none of them — its Content-Security-Policy would refuse them even if one got through."""
from __future__ import annotations

import html as stdlib_html
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pilotrun.ledger.records import GateRow, RunEnd, RunKind, RunStatus, Series, StopKind
from pilotrun.ledger.store import Ledger
from pilotrun.report.html import CSP, render
from tests.conftest import open_in_chromium, pilotrun_cli

# Each would set data-pwned on <html> if the browser ran it; the --dump-dom output then shows the attribute. The
# words "data-pwned" are not in any payload, so escaped text cannot fake a hit.
PAYLOADS = ("<img src=x onerror=\"document.documentElement.dataset.pwned='img'\">",
            "</script><script>document.documentElement.dataset.pwned='script'</script>",
            "\"><svg onload=\"document.documentElement.dataset.pwned='svg'\">",
            "'><img src=x onerror=document.documentElement.dataset.pwned='quote'>",
            "</title></textarea></pre><script>document.documentElement.dataset.pwned='title'</script>")
BAD = " ".join(PAYLOADS)
CID = "sweep-20261201-000000-abcd"


def _lock(bad: str) -> dict:
    return {"config_hash": bad, "versions": {"python": bad, "torch": bad, "cuda": bad},
            "model": {"name": bad, "files": {"sha256": bad}}, "data": {"sha256": bad, "source": bad},
            "container": {"digest": bad, "from": bad}, "code": {"commit": bad, "dirty": True}}


def _hostile_ledger(tmp_path: Path) -> Path:
    """A real ledger file: a campaign of two runs and a pilot whose every text field carries the payloads."""
    path = tmp_path / "l.sqlite"
    out = tmp_path / "out"
    out.mkdir()
    # A selection sheet saved beside the runs (select --json > selection.json), its strings hostile too.
    row = {"accelerator": BAD, "fits": True, "strategy": BAD, "gpus": 1, "micro_batch_size": 2, "grad_accum_steps": 1,
           "device_used_bytes": 1 << 30, "seconds_per_update": 1.0, "cost_per_update": 0.1,
           "cost_for_planned_updates": 1.0, "software_stack": {"text": BAD}, "experiment": BAD}
    (out / "selection.json").write_text(json.dumps({"rows": [row]}))
    with Ledger(path) as led:
        meta = {"key": f"train.{BAD}", "values": [BAD, 0.1], "seeds": [BAD], "parallel": {"text": BAD, "warnings": [BAD]},
                "campaign": {"stop": {BAD: BAD}, "updates": BAD}}
        led.start_run(CID, f"sweep {BAD}", RunKind.CAMPAIGN, out_dir=str(out), lock=_lock(BAD), meta=meta)
        for n, variant in ((1, BAD), (2, 0.1)):
            run_id = f"{CID}-r0{n}"
            led.start_run(run_id, f"sweep {BAD}", RunKind.CAMPAIGN_RUN, lock=_lock(BAD),
                          parent_id=f"{CID}-r01" if n == 2 else None,
                          meta={"campaign_id": CID, "variant": variant, "seed": BAD, "key": f"train.{BAD}",
                                "control": n == 1, "changes": {BAD: BAD}, "retry_of": BAD, "lock_drift": [BAD]})
            led.add_metrics(run_id, Series.TRAIN, [{"step": s, "loss": 3.0 / s, "lr": 0.1} for s in (1, 2, 3)])
            led.add_metrics(run_id, Series.VAL, [{"step": 3, "loss": 1.5}])
            led.finish_campaign_run(run_id, RunEnd(RunStatus.DIVERGED, StopKind.BUDGET, BAD, 3))
            led.add_note(run_id, BAD)
        led.end_run(CID, RunStatus.FINISHED)
        led.add_note(CID, BAD)
        led.start_run("pilot-hostile", f"pilot {BAD}", RunKind.PILOT, out_dir=str(out), lock=_lock(BAD))
        led.add_gate_row("pilot-hostile", GateRow.now("first_step", "fail", BAD, memory={
            "peak_allocated_bytes": 1 << 30, "peak_reserved_bytes": 2 << 30}, seconds=1.0))
        led.add_gate_row("pilot-hostile", GateRow.now("load", "warn", BAD, details={"parameters": 10,
                                                                                     "trainable_parameters": 1}))
        led.add_gate_row("pilot-hostile", GateRow.now("export", "pass", BAD))
        led.add_note("pilot-hostile", BAD)
    return path


class _Markup(HTMLParser):
    """Every element and attribute the browser's parser would build, and every script's text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def _assert_inert(page: str) -> None:
    for p in PAYLOADS:
        assert p not in page
        assert stdlib_html.escape(p, quote=True) in page, f"{p!r} is not on the page as escaped text"
    parsed = _Markup()
    parsed.feed(page)
    handlers = [(t, a) for t, attrs in parsed.tags for a, _ in attrs if a.startswith("on")]
    assert not handlers, handlers
    assert [t for t, _ in parsed.tags if t in ("script", "iframe", "object", "embed", "base", "form")] == ["script"]
    assert len(parsed.scripts) == 1 and "pwned" not in parsed.scripts[0]
    # Images are the plots only: data: PNGs (the hostile <img src=x> stayed text).
    assert all((dict(a).get("src") or "").startswith("data:image/png;base64,") for t, a in parsed.tags if t == "img")
    csp = [dict(a) for t, a in parsed.tags if t == "meta" and dict(a).get("http-equiv") == "Content-Security-Policy"]
    assert [c["content"] for c in csp] == [CSP]
    assert "'unsafe-inline'" not in CSP.split("script-src")[1].split(";")[0]


@pytest.mark.parametrize("ref", [CID, f"{CID}-r01", f"{CID}-r02", "pilot-hostile"])
def test_hostile_values_appear_only_as_escaped_text(tmp_path, ref):
    with Ledger(_hostile_ledger(tmp_path)) as led:
        page, _ = render(led, ref)
    _assert_inert(page)
    assert page.count("<table") >= 2 and "<h2>Lock</h2>" in page  # the tables and the lock were rendered, with them


def _pwned(dom: str) -> str | None:
    tag = dom[dom.index("<html"):dom.index(">", dom.index("<html"))]
    return tag.split('data-pwned="')[1].split('"')[0] if 'data-pwned="' in tag else None


@pytest.mark.process
@pytest.mark.browser
def test_hostile_values_run_no_script_in_a_real_browser(tmp_path):
    ledger = _hostile_ledger(tmp_path)
    # The detector works: the same payloads written raw into a page do run in this browser ...
    raw = tmp_path / "raw.html"
    raw.write_text(f"<!doctype html><html><head><title>t</title></head><body>{BAD}</body></html>")
    dom, _, _ = open_in_chromium(raw, tmp_path)
    assert _pwned(dom) is not None, dom[:400]
    # ... and the report's policy alone stops them (were one to get past the escaping).
    raw_csp = tmp_path / "raw-csp.html"
    raw_csp.write_text(f"<!doctype html><html><head><meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
                       f"<title>t</title></head><body>{BAD}</body></html>")
    dom, console, _ = open_in_chromium(raw_csp, tmp_path)
    assert _pwned(dom) is None and "Content Security Policy" in " ".join(console), console
    for ref in (CID, f"{CID}-r02", "pilot-hostile"):
        page = tmp_path / f"{ref}.html"
        res = pilotrun_cli("report", ref, "--ledger", str(ledger), "--out", str(page), cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        dom, console, _ = open_in_chromium(page, tmp_path)
        assert _pwned(dom) is None, ref
        # The page's own check ran (the policy allows it by its hash) and every plot decoded.
        images = dom.split('data-images="')[1].split('"')[0]
        assert images == dom.split('data-images-decoded="')[1].split('"')[0], ref
        assert not [c for c in console if "Uncaught" in c or "Content Security Policy" in c], console
        assert "dataset.pwned='img'" in dom  # the payload is on the page, as text


def test_hostile_text_in_the_inline_svg_plot_stays_text():
    """The memory plot is inline SVG with its text kept as text: matplotlib's writer escapes what it draws."""
    from pilotrun.ledger.records import GateRow
    from pilotrun.report.plots import inline_svg, memory_figure

    stages = [GateRow.now(f"first_step {BAD}", "pass", BAD, world_size=2, rank=1,
                          memory={"peak_allocated_bytes": 1 << 30, "peak_reserved_bytes": 2 << 30})]
    svg = inline_svg(memory_figure(stages, {BAD: 80 << 30}), BAD)
    assert not [p for p in PAYLOADS if p in svg]
    parsed = _Markup()
    parsed.feed(svg)
    assert not [(t, a) for t, attrs in parsed.tags for a, _ in attrs if a.startswith("on")]
    assert not [t for t, _ in parsed.tags if t in ("script", "img", "foreignobject", "iframe")]
    assert "dataset.pwned=&#x27;img&#x27;" in svg or "dataset.pwned='img'" in svg  # drawn, as text
