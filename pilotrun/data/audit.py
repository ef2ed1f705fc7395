"""What the loss sees, and whether the splits leak: functions from a DataBundle to plain data.

:func:`render_example` shows one item exactly as the collate hands it to the model
(token by token, supervised positions marked); :func:`scan_split` counts over a
whole split; :func:`audit_splits` checks ids, groups and identical inputs across
splits. None of them prints.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .bundle import DataBundle

IGNORE = -100
ProgressFn = Callable[[int, int, str], None]


def no_progress(done: int, total: int, text: str) -> None:
    """The default progress callback: ``progress(done, total, what)``."""
    return None


@dataclass
class TokenView:
    text: str
    token_id: int
    supervised: bool
    padding: bool
    label_id: int | None = None  # the target at this position, when it differs from the input token


@dataclass
class ExampleView:
    id: str
    split: str
    tokens: list[TokenView] | None = None
    label_index: int | None = None
    label_name: str | None = None
    label_value: float | None = None
    input_tokens: int = 0
    supervised: int = 0
    padding: int = 0
    keys: list[str] = field(default_factory=list)

    def plain(self) -> str:
        """One line a person can read: [supervised] tokens in brackets, padding as ·."""
        if self.tokens is None:
            head = ""
        else:
            parts = []
            for t in self.tokens:
                if t.padding:
                    parts.append("·")
                elif t.supervised:
                    parts.append(f"[{t.text}]")
                else:
                    parts.append(t.text)
            head = "".join(parts)
        if self.label_index is not None:
            name = f" ({self.label_name})" if self.label_name is not None else ""
            head = f"{head}  -> label {self.label_index}{name}".strip()
        elif self.label_value is not None:
            head = f"{head}  -> target {self.label_value:g}".strip()
        return head


def _piece(decode, ids: list[int], pos: int, context: int = 8) -> str:
    """The text token ``pos`` adds, decoded with a few tokens of context so word-piece and
    byte-level tokenizers keep their spaces ("##ing", "Ġthe")."""
    start = max(0, pos - context)
    before = decode(ids[start:pos]) if pos > start else ""
    after = decode(ids[start : pos + 1])
    return after[len(before):] if after.startswith(before) else decode([ids[pos]])


def _first(batch: Mapping, key: str):
    t = batch.get(key)
    return t[0] if isinstance(t, torch.Tensor) and t.ndim >= 1 else None


def _id(item, position: int) -> str:
    """An item's id for the reason; its position where it has none (a framework's dataset need not carry one)."""
    return str(item["id"]) if isinstance(item, dict) and item.get("id") is not None else f"#{position}"


def render_example(bundle: DataBundle, item: dict, split: str, position: int = 0) -> ExampleView:
    """``item`` (at ``position`` in its split: its name when it has no id) as the collate hands it to the model."""
    batch = bundle.collate([item])
    view = ExampleView(id=_id(item, position), split=split, keys=sorted(batch) if isinstance(batch, Mapping) else [])
    if not isinstance(batch, Mapping):  # a dict, or a collator's BatchEncoding (a UserDict)
        return view
    ids = _first(batch, "input_ids")
    mask = _first(batch, "attention_mask")
    labels = batch.get("labels")
    if isinstance(ids, torch.Tensor) and ids.ndim == 1:
        n = ids.shape[0]
        pad = (mask == 0).tolist() if isinstance(mask, torch.Tensor) and mask.shape[0] == n else [False] * n
        lab_row: torch.Tensor | None = (labels[0] if isinstance(labels, torch.Tensor) and labels.ndim == 2
                                        and labels.shape[1] == n else None)
        decode = bundle.decode
        id_list = [int(x) for x in ids.tolist()]
        toks = []
        for pos in range(n):
            tid = id_list[pos]
            text = _piece(decode, id_list, pos) if decode is not None else f"<{tid}>"
            lab = int(lab_row[pos]) if lab_row is not None else None
            sup = lab is not None and lab != IGNORE
            lab = lab if sup else None
            toks.append(TokenView(text=text, token_id=tid, supervised=sup, padding=bool(pad[pos]),
                                  label_id=lab if lab is not None and lab != tid else None))
        view.tokens = toks
        view.input_tokens = sum(1 for t in toks if not t.padding)
        view.padding = sum(1 for t in toks if t.padding)
    if isinstance(labels, torch.Tensor):
        if labels.ndim == 1 and labels.numel() == 1:
            if labels.is_floating_point():
                view.label_value = float(labels[0])
                view.supervised = 1
            else:
                view.label_index = int(labels[0])
                view.supervised = int(view.label_index != IGNORE)
                names = bundle.label_names
                if names is not None and 0 <= view.label_index < len(names):
                    view.label_name = names[view.label_index]
        elif labels.ndim >= 2:
            view.supervised = int((labels[0] != IGNORE).sum())
    return view


def _per_row_supervised(labels: torch.Tensor) -> list[int]:
    if labels.ndim == 1:
        if labels.is_floating_point():
            return [1] * labels.shape[0]
        return (labels != IGNORE).long().tolist()
    return (labels != IGNORE).reshape(labels.shape[0], -1).sum(1).tolist()


def scan_split(bundle: DataBundle, split: str = "train", chunk: int = 64, progress: ProgressFn = no_progress,
               limit: int | None = None) -> dict:
    """Counts over a whole split (its first ``limit`` examples when given), as the collate produces it (truncation
    and masking included)."""
    ds = getattr(bundle, split)
    total = len(ds)
    n = total if limit is None else min(total, limit)
    unsupervised: list[str] = []
    supervised_total = input_total = 0
    label_counts: Counter = Counter()
    label_kind = None
    prompt_supervised: list[str] = []
    for start in range(0, n, chunk):
        items = [ds[i] for i in range(start, min(n, start + chunk))]
        batch = bundle.collate(items)
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor):
            raise TypeError("the collate returned no 'labels' tensor "
                            f"(keys: {sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__})")
        rows = _per_row_supervised(labels)
        for pos, (it, s) in enumerate(zip(items, rows), start=start):
            if s == 0:
                unsupervised.append(_id(it, pos))
        supervised_total += sum(rows)
        mask = batch.get("attention_mask")
        ids = batch.get("input_ids")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            input_total += int(mask.sum())
        elif isinstance(ids, torch.Tensor) and ids.ndim == 2:
            input_total += ids.numel()
        if labels.ndim == 1 and not labels.is_floating_point():
            label_kind = "class"
            label_counts.update(int(v) for v in labels.tolist() if v != IGNORE)
        elif labels.ndim >= 2:
            label_kind = "token"
        if bundle.builtin:
            # The built-in SFT task's own item format (data/tasks.py) carries prompt_len and labels. A factory's
            # items promise only the contract's fields (id, group_key): a key of the same name there means
            # whatever the user meant by it, and everything else is read from the collated batch above.
            for it in items:
                plen = it.get("prompt_len")
                if plen and any(label != IGNORE for label in it["labels"][:plen]):
                    prompt_supervised.append(str(it["id"]))
        progress(min(n, start + chunk), n, f"{split} examples")
    out = {
        "split": split,
        "examples": total,
        "scanned": n,
        "unsupervised_examples": len(unsupervised),
        "unsupervised_share": len(unsupervised) / n if n else 0.0,
        "unsupervised_ids": unsupervised[:20],
        "supervised_labels": supervised_total,
        "label_kind": label_kind,
        "prompt_supervised_ids": prompt_supervised[:20],
        "prompt_supervised_examples": len(prompt_supervised),
    }
    if label_kind == "token" and input_total:
        out["input_tokens"] = input_total
        out["supervised_token_share"] = supervised_total / input_total
    if label_kind == "class":
        names = bundle.label_names
        out["label_distribution"] = {
            (names[k] if names is not None and 0 <= k < len(names) else str(k)): v
            for k, v in sorted(label_counts.items())
        }
        out["class_indices"] = sorted(label_counts)
    return out


def class_problems(scan: dict, label_names: list[str] | None, num_outputs: int | None,
                   model_id2label: dict | None) -> list[str]:
    """Class indices the model cannot output, and names that disagree with the model config."""
    problems = []
    indices = scan.get("class_indices") or []
    if num_outputs is not None and indices:
        bad = [i for i in indices if i < 0 or i >= num_outputs]
        if bad:
            problems.append(f"class indices {bad[:10]} are outside the model's {num_outputs} outputs")
    if label_names and model_id2label:
        ordered = [model_id2label.get(i, model_id2label.get(str(i))) for i in range(len(model_id2label))]
        default = all(str(n) == f"LABEL_{i}" for i, n in enumerate(ordered))
        if not default and ordered[: len(label_names)] != list(label_names):
            diffs = [f"{i}: model {m!r} vs data {d!r}" for i, (m, d) in enumerate(zip(ordered, label_names)) if m != d]
            extra = ("" if len(ordered) == len(label_names)
                     else f" (model has {len(ordered)} classes, data {len(label_names)})")
            problems.append(f"the model config's id2label disagrees with the data's class names{extra}: "
                            + "; ".join(diffs[:5]))
    return problems


def _fingerprint(ds, i: int, item: dict, drop: set[str]) -> str:
    fp = getattr(ds, "fingerprint", None)
    if callable(fp):
        return fp(i)
    payload = {}
    for k, v in item.items():
        if k in drop:
            continue
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        payload[k] = v
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def audit_splits(bundle: DataBundle, progress: ProgressFn = no_progress) -> dict:
    """Ids, groups and identical inputs across splits. Fails: a group or an id in two splits, a repeated id."""
    key = bundle.group_key
    splits = {name: ds for name, ds in (("train", bundle.train), ("val", bundle.val), ("test", bundle.test))
              if ds is not None}
    drop = {"id", "label", "labels"} | ({key} if key else set())
    ids_by_split: dict[str, Counter] = {}
    groups: dict[str, dict[str, int]] = defaultdict(dict)  # group -> split -> examples
    prints: dict[str, dict[str, str]] = defaultdict(dict)  # fingerprint -> split -> an id
    missing_group = 0
    bad_ids: list[str] = []
    total = sum(len(ds) for ds in splits.values())
    done = 0
    for name, ds in splits.items():
        ids: Counter = Counter()
        for i in range(len(ds)):
            item = ds[i]
            raw = item.get("id") if isinstance(item, dict) else None
            if not isinstance(raw, (str, int)) or isinstance(raw, bool) or raw == "":
                what = "no 'id'" if not isinstance(item, dict) or "id" not in item else f"id {raw!r}"
                bad_ids.append(f"{name} item {i} has {what}")
                continue
            ids[str(raw)] += 1
            if key:
                if key in item:
                    g = str(item[key])
                    groups[g][name] = groups[g].get(name, 0) + 1
                else:
                    missing_group += 1
            prints[_fingerprint(ds, i, item, drop)].setdefault(name, str(item["id"]))
            done += 1
            if done % 256 == 0 or done == total:
                progress(done, total, "examples audited")
        ids_by_split[name] = ids
    repeated = {name: [i for i, c in ids.items() if c > 1] for name, ids in ids_by_split.items()}
    repeated = {k: v for k, v in repeated.items() if v}
    names = list(ids_by_split)
    shared_ids = []
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            both = sorted(set(ids_by_split[a]) & set(ids_by_split[b]))
            if both:
                shared_ids.append({"splits": [a, b], "count": len(both), "ids": both[:10]})
    leaking_groups = {g: per for g, per in groups.items() if len(per) > 1}
    identical = [per for per in prints.values() if len(per) > 1]
    return {
        "group_key": key,
        "sizes": {name: len(ds) for name, ds in splits.items()},
        "groups": {name: sum(1 for per in groups.values() if name in per) for name in splits} if key else None,
        "repeated_ids": {k: v[:10] for k, v in repeated.items()},
        "shared_ids": shared_ids,
        "leaking_groups": dict(sorted(leaking_groups.items())[:20]),
        "leaking_group_count": len(leaking_groups),
        "leaking_group_examples": sum(sum(per.values()) for per in leaking_groups.values()),
        "identical_inputs": identical[:10],
        "identical_input_count": len(identical),
        "items_without_group": missing_group,
        "bad_ids": bad_ids[:10],
        "bad_id_count": len(bad_ids),
    }
