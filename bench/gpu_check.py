"""``make gpu-check``: everything a lent GPU should tell us, in one command under 8 minutes.

    .venv/bin/python bench/gpu_check.py                  # on a machine with one CUDA GPU
    .venv/bin/python bench/gpu_check.py --dry --out /tmp/x   # CPU: the same code, measured on the CPU

On a GPU it (1) runs the ``gpu``-marked tests, (2) pilots a job at a rented size first -- a 1B Llama shape at
length 2048 (bench/specs/llama-1b): full bf16-true with checkpointing and fused AdamW, then without checkpointing,
LoRA, foreach AdamW and length 4096 -- then the demo (examples/tiny-sft) and the LoRA example (examples/lora-sft)
on CUDA in fp32, bf16, bf16-true and, when bitsandbytes has a CUDA build, QLoRA and 8-bit AdamW, (3) compares
every stage's estimate (the fake-tensor trace placed on this
accelerator's catalog entry) with what the pilot's meter read (torch.cuda.max_memory_allocated,
max_memory_reserved, and the device's used memory from mem_get_info, less what was in use before),
(4) fits the catalog's ``reserved_margin`` and ``utilisation`` and the runtime context from those
measurements, sets the estimated time per update beside the measured one, and (5) writes
bench/results/gpu_check-<device>-<date>.json and .md.

A variant whose feature is not on this branch, or whose kernel this machine lacks, is listed with
"not measured: <reason>"; one the time budget did not reach says so too. ``--dry`` replaces only
:func:`device_facts` (the one function that asks the device): the pilots run on the CPU, the
estimates are for the catalog's H200 (the machine these sessions are lent), and the results are
marked dry -- so the planning, comparison, fit and writing code runs in CI and cannot rot.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import RESULTS, machine  # noqa: E402

from pilotrun.config import load_spec  # noqa: E402
from pilotrun.config.schema import SpecError  # noqa: E402
from pilotrun.estimate.catalog import Accelerator, load_catalog, matches  # noqa: E402
from pilotrun.estimate.model import STAGES, seconds_per_update, stage_memory  # noqa: E402
from pilotrun.estimate.worker import TraceError, trace_in_subprocess  # noqa: E402

BUDGET_S = 450  # the whole check, tests included, stays under 8 minutes on one GPU with margin
# The real-size job first: the budget may not reach the last items, and these are the measurements the estimator
# is judged by (the demo-sized ones are launch-bound).
EXAMPLES = {"llama-1b": REPO / "bench" / "specs" / "llama-1b" / "pilot.yaml",
            "tiny-sft": REPO / "examples" / "tiny-sft" / "pilot.yaml",
            "lora-sft": REPO / "examples" / "lora-sft" / "pilot.yaml"}
DEMOS = ("tiny-sft", "lora-sft")
# A dry run pilots on the CPU: the 1B job there keeps its structure (Llama, bf16-true, checkpointing, the
# variants' switches) at the LoRA example's size, so the code runs in CI in seconds; it measures nothing real.
DRY_SHRINK = {"llama-1b": ("model.config.num_hidden_layers=2", "model.config.hidden_size=64",
                           "model.config.intermediate_size=176", "model.config.num_attention_heads=4",
                           "model.config.num_key_value_heads=2", "model.config.vocab_size=512",
                           "data.max_length=96", "eval.max_length=96")}
LORA_1B = ("model.adapter={type: lora, r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, "
           "o_proj, gate_proj, up_proj, down_proj]}")
MEMORY_GATES = "first_step,steady_step,eval"  # what the comparison reads; the fp32 variant runs every gate
PEAK_KEY = {"bf16-true": "bf16"}  # train.precision -> the catalog's peak_tflops key, where they differ
DRY_ACCELERATOR = "H200-141GB"  # the dry run estimates for the device these sessions are lent


class Need(str, Enum):
    """What a variant needs beyond the demo; :func:`missing` says why it is not measured when absent."""

    LORA_EXAMPLE = "examples/lora-sft"
    PURE_BF16 = "bf16-true training"
    BNB_KERNELS = "bitsandbytes layers and optimizers"
    BNB_CUDA = "bitsandbytes CUDA build"


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]
    needs: tuple[Need, ...] = ()
    examples: tuple[str, ...] = DEMOS
    all_gates: bool = False


VARIANTS = (
    # The 1B Llama at length 2048 (bench/specs/llama-1b): a full fine-tune in bf16-true with checkpointing and
    # AdamW's fused kernel (fused: auto takes it on CUDA), then one change each.
    Variant("full-bf16-true", (), (Need.PURE_BF16,), examples=("llama-1b",)),
    Variant("no-checkpointing", ("train.activation_checkpointing=false",), (Need.PURE_BF16,), examples=("llama-1b",)),
    Variant("lora", (LORA_1B,), (Need.PURE_BF16,), examples=("llama-1b",)),
    Variant("foreach-adamw", ("train.optimizer.fused=false",), (Need.PURE_BF16,), examples=("llama-1b",)),
    Variant("length-4096", ("data.max_length=4096", "eval.max_length=4096"), (Need.PURE_BF16,),
            examples=("llama-1b",)),
    Variant("fp32", ("train.precision=fp32",), all_gates=True),
    Variant("bf16", ("train.precision=bf16",)),
    Variant("bf16-true", ("train.precision=bf16-true",), (Need.PURE_BF16,)),
    Variant("qlora", ("model.quantization={bits: 4, type: nf4, double_quant: true, compute_dtype: bf16}",
                      "train.precision=bf16"), (Need.BNB_KERNELS, Need.BNB_CUDA), examples=("lora-sft",)),
    Variant("adamw8bit", ("train.optimizer.name=adamw8bit",), (Need.BNB_KERNELS, Need.BNB_CUDA)),
)


def device_facts(dry: bool) -> dict:
    """The one function that asks the device: its name, memory, what is in use now, bitsandbytes' build.

    ``dry``: no CUDA call at all; the pilots run on the CPU and the estimates are for the catalog's H200."""
    if dry:
        return {"dry": True, "device": "cpu", "name": f"dry run on CPU (estimates for {DRY_ACCELERATOR})",
                "catalog": DRY_ACCELERATOR, "total_bytes": None, "used_bytes": None, "bnb_cuda": False,
                "bnb_reason": "dry run: no CUDA device"}
    from pilotrun.devices import query_devices

    inv = query_devices()  # pilotrun's own device query; the counters are its backend's (pilotrun.backends)
    runtime = inv.runtime
    if not runtime.indexed or not inv.count:
        raise SystemExit("gpu_check: no CUDA/ROCm device visible; run with --dry on a CPU machine")
    device = runtime.device(0)
    facts = {"dry": False, "device": runtime.device_type, "backend": inv.backend, "name": inv.names[0],
             "catalog": None, "total_bytes": runtime.total_memory(device),
             "used_bytes": runtime.device_used(device).value, "torch_cuda": inv.versions.get("cuda"),
             "hip": inv.versions.get("hip")}
    try:
        from bitsandbytes.cextension import CudaBNBNativeLibrary, lib

        facts["bnb_cuda"] = isinstance(lib, CudaBNBNativeLibrary)
        facts["bnb_reason"] = "" if facts["bnb_cuda"] else f"bitsandbytes loaded {type(lib).__name__}, no CUDA build"
    except Exception as exc:  # not installed, or its native library failed to load: the reason is the answer
        facts["bnb_cuda"], facts["bnb_reason"] = False, f"bitsandbytes unusable: {type(exc).__name__}: {exc}"
    return facts


def missing(need: Need, facts: dict) -> str | None:
    """Why ``need`` is not met here (the "not measured" reason), or None."""
    if need == Need.LORA_EXAMPLE and not EXAMPLES["lora-sft"].exists():
        return "examples/lora-sft is not on this branch (branch lora adds it)"
    # bf16-true, adapters and bitsandbytes bases land together in pilotrun/models/{adapters,quantize}.py; without
    # them the spec accepts the keys but nothing consumes them, and a pilot would silently train something else.
    if need == Need.PURE_BF16 and importlib.util.find_spec("pilotrun.models.adapters") is None:
        return "train.precision bf16-true is not consumed on this branch (branch lora adds it)"
    if need == Need.BNB_KERNELS and importlib.util.find_spec("pilotrun.models.quantize") is None:
        return "bitsandbytes bases and 8-bit optimizers are not consumed on this branch (branch lora adds them)"
    if need == Need.BNB_CUDA and not facts.get("bnb_cuda"):
        return f"needs a CUDA build of bitsandbytes ({facts.get('bnb_reason')})"
    return None


def plan(facts: dict, only: set[str] | None = None) -> list[dict]:
    """Every (example, variant) with its overrides, or the reason it is not measured."""
    items = []
    for example in EXAMPLES:
        for v in VARIANTS:
            key = f"{example}:{v.name}"
            if example not in v.examples or (only is not None and key not in only):
                continue
            needs = ((Need.LORA_EXAMPLE,) if example == "lora-sft" else ()) + v.needs
            reasons = [r for r in (missing(n, facts) for n in needs) if r]
            shrink = DRY_SHRINK.get(example, ()) if facts.get("dry") else ()
            items.append({"key": key, "example": example, "variant": v.name,
                          "overrides": [*shrink, *v.overrides, f"train.device={facts['device']}"],
                          "gates": None if v.all_gates else MEMORY_GATES,
                          "not_measured": f"not measured: {reasons[0]}" if reasons else None})
    return items


def accelerator(facts: dict) -> Accelerator:
    """This device's catalog entry (the dry run's: the H200); a device not in the catalog is built from its facts."""
    catalog = load_catalog()
    if facts["catalog"]:
        return catalog[facts["catalog"]]
    for acc in catalog.values():
        if matches(acc, facts["name"]):
            return acc
    base = next(iter(catalog.values()))
    return Accelerator(name=facts["name"], vendor="unknown", stack=facts.get("backend", "cuda"),
                       memory_bytes=facts["total_bytes"], memory_spec_gb=0, bandwidth_tb_s=0, peak_tflops={},
                       interconnect={}, context_bytes=base.context_bytes,
                       blas_workspace_bytes=base.blas_workspace_bytes, nccl_buffer_bytes=base.nccl_buffer_bytes,
                       notes="not in the catalog: capacity as the device reports it, peaks unknown",
                       defaults=base.defaults)


COUNTERS = (("allocated", "peak_allocated_bytes"), ("reserved", "peak_reserved_bytes"), ("used", "device_used_bytes"))


def compare(estimates: dict[str, dict], rows: list[dict], used_before: int | None) -> list[dict]:
    """Per stage and counter: estimate, measured, ratio -- or the meter's own "not measured" reason.

    The device's used memory counts every process: what was in use before the pilot started is taken off."""
    out = []
    by_gate = {r["gate"]: r for r in rows}
    for stage in STAGES:
        row, est = by_gate.get(stage), estimates.get(stage)
        if row is None or est is None:
            out.append({"stage": stage, "not_measured": f"not measured: no {stage} row" if row is None else
                        f"not measured: no {stage} estimate"})
            continue
        mem = row.get("memory") or {}
        why = mem.get("not_measured") or {}
        for counter, key in COUNTERS:
            value = mem.get(key)
            if value is not None and counter == "used" and used_before is not None:
                value -= used_before
            entry = {"stage": stage, "counter": counter, "estimated_bytes": est[key], "measured_bytes": value}
            if value:
                entry["ratio"] = est[key] / value
            else:
                entry["not_measured"] = f"not measured: {why.get(key) or 'the meter gave no value'}"
            out.append(entry)
    return out


def fit(results: list[dict], acc: Accelerator) -> dict:
    """The catalog's reserved margin and utilisation, and the runtime context, from what was measured.

    reserved_margin: the largest measured reserved/allocated - 1 (the estimate multiplies allocated by 1 + margin;
    under-predicting reserved memory is the costly error). utilisation: the median over variants of FLOPs per
    update / (measured seconds per update x datasheet peak); tiny models are launch-bound, so this is a floor
    for real jobs. context: median device used - reserved (CUDA context and anything outside the allocator)."""
    margins, utils, contexts, ratios = [], [], [], []
    for r in results:
        for row in r.get("rows", []):
            mem = row.get("memory") or {}
            alloc, reserved, used = (mem.get(k) for _, k in COUNTERS)
            if row["gate"] in STAGES and alloc and reserved:
                margins.append(reserved / alloc - 1)
                if used and r.get("used_before") is not None:
                    contexts.append(used - r["used_before"] - reserved)
        if r.get("utilisation"):
            utils.append(r["utilisation"])
        if (r.get("time") or {}).get("ratio"):
            ratios.append(r["time"]["ratio"])
    catalog = {"reserved_margin": acc.defaults.get("reserved_margin"), "utilisation": acc.defaults.get("utilisation"),
               "context_bytes": acc.context_bytes}
    return {
        "catalog_now": catalog,
        "reserved_margin": ({"fitted": max(margins), "median": statistics.median(margins), "n": len(margins)}
                            if margins else "not measured: no stage had both allocated and reserved counters"),
        "utilisation": ({"fitted": statistics.median(utils), "n": len(utils),
                         "caveat": "the demo-sized models are launch-bound (a floor); read the 1B items per item"}
                        if utils else "not measured: no steady_step time against a datasheet peak"),
        "context_bytes": ({"fitted": int(statistics.median(contexts)), "n": len(contexts)}
                          if contexts else "not measured: no device-level used memory"),
        "time_ratio": ({"median": statistics.median(ratios), "n": len(ratios),
                        "caveat": "estimated / measured seconds per update; launch gaps are not modelled, so small "
                                  "models read low"} if ratios else "not measured: no steady_step time"),
    }


def run_item(item: dict, facts: dict, acc: Accelerator, deadline: float, work: Path) -> dict:
    """Trace and estimate one variant, pilot it in a fresh process, compare."""
    left = deadline - time.monotonic()
    if left < 30:
        return {**item, "not_measured": f"not measured: the {BUDGET_S} s budget ran out before it"}
    spec_path = EXAMPLES[item["example"]]
    try:
        spec = load_spec(spec_path, item["overrides"])
    except SpecError as exc:
        return {**item, "not_measured": f"not measured: the spec is refused ({exc})"}
    t0 = time.perf_counter()
    trace, estimates, estimate_error = None, {}, None
    try:  # a job the estimator cannot trace is still piloted: its rows say "no estimate", with this reason
        trace = trace_in_subprocess(spec, target="cuda", timeout=max(30.0, left / 2))
        estimates = {s: stage_memory(trace, s, acc, "single", 1) for s in STAGES}
    except TraceError as exc:
        estimate_error = f"the estimate failed: {exc}"
    traced = time.perf_counter() - t0
    used_before = facts_used(facts)
    folder = work / item["key"].replace(":", "-")
    cmd = [sys.executable, "-m", "pilotrun", "run", str(spec_path), "--json", "--out", str(folder / "out"),
           "--ledger", str(folder / "ledger.sqlite")]
    cmd += [w for o in item["overrides"] for w in ("--set", o)] + (["--gates", item["gates"]] if item["gates"] else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder.parent,
                              timeout=max(10.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return {**item, "not_measured": f"not measured: the pilot ran past the {BUDGET_S} s budget"}
    if not proc.stdout.strip().startswith("{"):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**item, "status": "error", "not_measured": f"not measured: the pilot exited {proc.returncode}: {tail}"}
    report = json.loads(proc.stdout)
    rows = report["gates"]
    out = {**item, "status": report["status"], "trace_seconds": traced,
           "pilot_seconds": time.perf_counter() - t0 - traced, "used_before": used_before,
           "rows": rows, "comparison": compare(estimates, rows, used_before),
           "failed_gates": [f"{r['gate']}: {r['reason']}" for r in rows if r["verdict"] == "fail"]}
    if estimate_error:
        out["estimate_error"] = estimate_error
    steady = next((r for r in rows if r["gate"] == "steady_step"), None)
    per_update = ((steady or {}).get("details") or {}).get("seconds_per_update")
    if trace is not None and per_update:
        # bf16-true computes in bf16 like autocast does: the same datasheet peak.
        peak = acc.peak_flops(PEAK_KEY.get(trace["precision"], trace["precision"]))
        flops = trace["stages"]["steady_step"].get("flops")
        if peak and flops:
            out["utilisation"] = flops / (per_update * peak)
        # The time model (each op the larger of FLOPs and bytes) against the measured update: kernel launch gaps are
        # not modelled, so on these small models the estimate is expected below the measurement.
        est = seconds_per_update(trace, acc, "single", 1, trace["precision"])
        if est.get("seconds"):
            out["time"] = {"estimated_seconds": est["seconds"], "measured_seconds": per_update,
                           "ratio": est["seconds"] / per_update, "model": est.get("model")}
    if item["variant"] == "bf16-true":  # never a silent fallback: the load row must show bf16 weights
        load = next((r for r in rows if r["gate"] == "load"), {})
        if not re.search(r"bf16|bfloat16", load.get("reason", "")):
            out["warning"] = f"the load row does not show bf16 weights: {load.get('reason', 'no load row')}"
    return out


def facts_used(facts: dict) -> int | None:
    """Device memory in use before a pilot (other processes, this one's context): from the one device function."""
    return device_facts(facts["dry"])["used_bytes"]


def gpu_tests(path: str, deadline: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=max(10.0, (deadline -
                                                                                             time.monotonic()) / 3))
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[2:]), "returncode": None, "summary": "timed out"}
    lines = [x for x in proc.stdout.strip().splitlines() if x.strip()]
    # pytest exits 5 when every test was deselected or skipped away: on a CPU that is the expected answer.
    return {"command": "python " + " ".join(cmd[1:]), "returncode": proc.returncode,
            "summary": lines[-1] if lines else proc.stderr.strip()[-300:]}


def _gib(n) -> str:
    return "—" if n is None else f"{n / 2**30:.3f}"


def markdown(payload: dict) -> str:
    lines = [f"# gpu-check on {payload['device']['name']} ({payload['date']})", ""]
    if payload["device"]["dry"]:
        lines += ["**Dry run**: measured on the CPU, estimated for the catalog's "
                  f"{payload['accelerator']}; the ratios test the code, not the estimator.", ""]
    t = payload["gpu_tests"]
    lines += [f"gpu-marked tests: `{t['command']}` → {t['summary']} (exit {t['returncode']})", "",
              "| example | variant | stage | counter | estimated GiB | measured GiB | ratio | note |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in payload["results"]:
        if r.get("not_measured"):
            lines.append(f"| {r['example']} | {r['variant']} | | | | | | {r['not_measured']} |")
            continue
        for note in (r.get("estimate_error"), r.get("warning"), *(r.get("failed_gates") or [])):
            if note:
                lines.append(f"| {r['example']} | {r['variant']} | | | | | | {note} |")
        for c in r["comparison"]:
            ratio = f"{c['ratio']:.3f}" if "ratio" in c else "—"
            lines.append(f"| {r['example']} | {r['variant']} | {c['stage']} | {c.get('counter', '')} | "
                         f"{_gib(c.get('estimated_bytes'))} | {_gib(c.get('measured_bytes'))} | {ratio} | "
                         f"{c.get('not_measured', '')} |")
    timed = [r for r in payload["results"] if r.get("time")]
    if timed:
        lines += ["", "## Time per update: the estimate (each op the larger of FLOPs and bytes) against the pilot", "",
                  "| example | variant | estimated s | measured s | ratio |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['example']} | {r['variant']} | {r['time']['estimated_seconds']:.4g} | "
                  f"{r['time']['measured_seconds']:.4g} | {r['time']['ratio']:.3f} |" for r in timed]
    lines += ["", "## Fitted from these measurements", "", "```", json.dumps(payload["fit"], indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="no CUDA: pilots on the CPU, results marked dry")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and the table go (bench/results)")
    ap.add_argument("--only", help="comma-separated example:variant keys to run (default: all)")
    ap.add_argument("--gpu-tests", default="tests", help="where pytest -m gpu looks (default: tests)")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + BUDGET_S
    facts = device_facts(args.dry)
    acc = accelerator(facts)
    t0 = time.perf_counter()
    tests = gpu_tests(args.gpu_tests, deadline)
    tests["seconds"] = time.perf_counter() - t0
    results = []
    with tempfile.TemporaryDirectory(prefix="pilotrun-gpu-check-") as tmp:
        for item in plan(facts, set(args.only.split(",")) if args.only else None):
            if item["not_measured"] is None:
                (Path(tmp) / item["key"].replace(":", "-")).mkdir()
                item = run_item(item, facts, acc, deadline, Path(tmp))
            results.append(item)
            print(f"{item['key']:<22} {item.get('status') or ''} {item.get('not_measured') or ''}".rstrip(),
                  flush=True)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    slug = "dry-cpu" if facts["dry"] else re.sub(r"[^a-z0-9]+", "-", facts["name"].lower()).strip("-")
    payload = {"date": date, "device": facts, "accelerator": acc.name, "machine": machine(), "budget_s": BUDGET_S,
               "gpu_tests": tests, "results": results, "fit": fit(results, acc)}
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / f"gpu_check-{slug}-{date}"
    base.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    base.with_suffix(".md").write_text(markdown(payload))
    print(f"written {base}.json and {base}.md")
    failed = [r["key"] for r in results if r.get("status") not in (None, "pass", "warn")]
    tests_ok = tests["returncode"] in (0, 5) if facts["dry"] else tests["returncode"] == 0
    return 0 if not failed and tests_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
