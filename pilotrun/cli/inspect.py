"""``pilotrun inspect SPEC``: examples exactly as the loss receives them, and counts over the split."""
from __future__ import annotations

import json

from rich.text import Text

from ..config.load import load_spec
from ..data.audit import render_example, scan_split
from ..data.bundle import build_data
from ..data.jsonl import DataError
from ..gates.inspect import judge
from ..gates.loop_view import model_label_info
from ..models.loading import ModelError, load_tokenizer
from .common import EXIT_GATE_FAILED, UsageError, command_parser, out_console

HELP = """examples:
  pilotrun inspect examples/tiny-sft/pilot.yaml            # 3 examples + counts over the training split
  pilotrun inspect pilot.yaml -n 10 --split val
  pilotrun inspect pilot.yaml --json

legend: [supervised tokens] in green brackets (the loss learns them), masked tokens (-100) plain grey,
padding as a dim dot; for classification the label index and its class name.
exit codes: 0 fine (warnings allowed), 1 a problem the inspect gate would fail on, 2 bad spec or data"""


def add_parser(sub) -> None:
    p = command_parser(sub, "inspect", __doc__, HELP)
    p.add_argument("spec", help="path to pilot.yaml")
    p.add_argument("-n", type=int, default=None, help="examples to show (default pilot.inspect.examples)")
    p.add_argument("--split", default="train", choices=["train", "val", "test"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def render(view) -> Text:
    text = Text()
    if view.tokens is not None:
        for t in view.tokens:
            if t.padding:
                text.append("·", style="dim")
            elif t.supervised:
                text.append(f"[{t.text}]" if t.label_id is None else f"[{t.text}→{t.label_id}]", style="bold green")
            else:
                text.append(t.text, style="grey62")
    if view.label_index is not None:
        name = f" ({view.label_name})" if view.label_name is not None else ""
        text.append(f"  → label {view.label_index}{name}", style="bold green" if view.label_index != -100 else "red")
    elif view.label_value is not None:
        text.append(f"  → target {view.label_value:g}", style="bold green")
    return text


def main(args) -> int:
    spec = load_spec(args.spec, args.overrides)
    try:
        tok = load_tokenizer(spec.model, spec.folder) if spec.data.task is not None else None
        data = build_data(spec.data, spec.build_context(), tok, spec.eval_max_length)
    except (DataError, ModelError) as exc:
        raise UsageError(str(exc)) from None
    ds = getattr(data, args.split)
    if ds is None:
        raise UsageError(f"the data has no {args.split!r} split")
    n = spec.pilot.inspect.examples if args.n is None else args.n
    views = [render_example(data, ds[i], args.split, position=i) for i in range(min(n, len(ds)))]
    scan = scan_split(data, args.split)
    problems, warnings, info = (judge(scan, data.label_names, model_label_info(spec, data.label_names),
                                      spec.pilot.inspect.max_unsupervised_share)
                                if args.split == "train" else ([], [], {}))
    if args.json:
        print(json.dumps({"examples": [{"id": v.id, "text": v.plain(), "supervised": v.supervised,
                                        "padding": v.padding, "batch_keys": v.keys} for v in views],
                          "scan": scan, "problems": problems, "warnings": warnings, "model_classes": info},
                         indent=1, default=str))
        return EXIT_GATE_FAILED if problems else 0
    console = out_console()
    for v in views:
        # Token counts only for token data (an input_ids row); an image or a table row has none to count.
        counts = (f"{v.input_tokens} input tokens, {v.supervised} supervised, {v.padding} padding · "
                  if v.tokens is not None else "")
        console.print(Text.assemble((f"{v.split} {v.id}", "bold"), f"  {counts}batch keys {', '.join(v.keys)}"))
        console.print(render(v))
        console.print()
    console.print(Text(f"{scan['examples']} {args.split} examples", style="bold"))
    if scan.get("supervised_token_share") is not None:
        console.print(f"  supervised tokens: {scan['supervised_labels']:,} of {scan['input_tokens']:,} input tokens "
                      f"({scan['supervised_token_share']:.1%})")
    if scan.get("label_distribution"):
        console.print("  classes: " + ", ".join(f"{k} {v}" for k, v in scan["label_distribution"].items()))
    console.print(f"  examples with no supervised label: {scan['unsupervised_examples']}"
                  + (f" (e.g. {', '.join(scan['unsupervised_ids'][:5])})" if scan["unsupervised_ids"] else ""))
    if data.task == "causal-lm":
        console.print(f"  examples that train on prompt tokens: {scan['prompt_supervised_examples']}")
    for w in warnings:
        console.print(Text(f"  ! {w}", style="yellow"))
    for p in problems:
        console.print(Text(f"  ✗ {p}", style="bold red"))
    return EXIT_GATE_FAILED if problems else 0
