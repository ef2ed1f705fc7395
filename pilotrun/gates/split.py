"""``split``: no leakage unit crosses splits. A group or an id in two splits fails; identical inputs warn."""
from __future__ import annotations

from ..data.audit import audit_splits
from ..ledger.records import GateName
from .base import Gate, GateFailure, OnProgram, Outcome, Product


class SplitGate(Gate):
    name = GateName.SPLIT
    on_program = OnProgram.NEVER
    program_note = ("the program splits its own data and pilotrun cannot see the leakage unit; give "
                    "data.factory with a group_key (or data.task) to have it checked")
    needs = (Product.DATA,)
    carry = True

    def track(self, ctx):
        return []

    def describe_inputs(self, ctx) -> dict:
        return {"group_key": ctx.data.group_key if ctx.data else None, "rank": ctx.rank, "world_size": ctx.world_size}

    def run(self, ctx, meter) -> Outcome:
        data = ctx.ensure_data()
        audit = audit_splits(data, progress=ctx.progress)
        out = Outcome(inputs=self.describe_inputs(ctx), details={"audit": audit, "how": data.notes})
        sizes = " / ".join(f"{k} {v}" for k, v in audit["sizes"].items())
        problems = []
        if audit["bad_id_count"]:
            problems.append(f"{audit['bad_id_count']} item(s) without a usable id (a non-empty string or integer): "
                            + "; ".join(audit["bad_ids"][:3]))
        if audit["leaking_group_count"]:
            shown = "; ".join(f"{g}: " + ", ".join(f"{n} in {s}" for s, n in per.items())
                              for g, per in list(audit["leaking_groups"].items())[:3])
            problems.append(f"{audit['leaking_group_count']} group(s) of {audit['group_key']!r} appear in two splits "
                            f"({audit['leaking_group_examples']} examples): {shown}")
        for shared in audit["shared_ids"]:
            problems.append(f"{shared['count']} id(s) in both {' and '.join(shared['splits'])} "
                            f"(e.g. {', '.join(shared['ids'][:5])})")
        for split, ids in audit["repeated_ids"].items():
            problems.append(f"ids repeat within {split} (e.g. {', '.join(ids[:5])}): ids must be unique")
        if problems:
            raise GateFailure("; ".join(problems), inputs=out.inputs, details=out.details)
        if audit["group_key"]:
            groups = " / ".join(f"{k} {v}" for k, v in audit["groups"].items())
            out.reason = (f"{sizes} examples in {groups} groups by {audit['group_key']!r}: no group, id or "
                          "input crosses splits")
        else:
            out.reason = f"{sizes} examples: no id crosses splits"
            out.warn("no group_key: leakage by conversation/document/patient was not audited (return 'group_key' "
                     "from the data factory)")
        if audit["items_without_group"]:
            out.warn(f"{audit['items_without_group']} item(s) have no {audit['group_key']!r} field")
        if audit["identical_input_count"]:
            ex = audit["identical_inputs"][0]
            out.warn(f"{audit['identical_input_count']} input(s) appear in more than one split (e.g. "
                     + ", ".join(f"{i} in {s}" for s, i in ex.items()) + ")")
        return out
