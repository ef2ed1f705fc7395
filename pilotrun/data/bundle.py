"""The data a pilot trains on, from a user's factory or a built-in task, checked against the contract.

Contract (README, "Your own model and data"): ``data.factory`` returns a mapping
with ``"train"`` and ``"val"`` (optionally ``"test"``) map-style datasets whose items
are dicts with an ``"id"``, a ``"collate"`` function from a list of items to a batch
dict of tensors including ``"labels"``, and optionally ``"decode"``, ``"label_names"``
and ``"group_key"``. Instead of the splits it may return ``"all"`` with a
``"group_key"``; pilotrun then splits by group, deterministically.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config.factories import factory_guard, import_factory
from ..config.paths import resolve_path
from ..config.sections import DataSpec
from ..config.spec import BuildContext
from .jsonl import DataError, read_jsonl
from .split import IndexedSubset, split_by_group
from .tasks import CausalLMDataset, ClassificationDataset, PadCollate, class_names, label_index

CONTRACT_KEYS = {"train", "val", "test", "all", "collate", "decode", "label_names", "group_key"}


@dataclass
class DataBundle:
    train: Any
    val: Any
    collate: Callable
    test: Any = None
    decode: Callable | None = None
    label_names: list[str] | None = None
    group_key: str | None = None
    task: str = "custom"  # causal-lm, seq-classification or custom
    # Built-in tasks can pad a collated batch to a length: the pilot measures the
    # long run's worst-case shape with it. User collates cannot be padded from outside.
    pad_batch: Callable | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def builtin(self) -> bool:
        """Items made by pilotrun's built-in tasks, whose format pilotrun knows (a factory's items promise only
        the contract's fields: id and group_key)."""
        return self.task != "custom"

    def sizes(self) -> dict[str, int]:
        out = {"train": len(self.train), "val": len(self.val)}
        if self.test is not None:
            out["test"] = len(self.test)
        return out


def held_out(data: DataSpec) -> dict[str, float]:
    return {"val": data.val_fraction, "test": data.test_fraction}


def _split_rows(rows: list[dict], data: DataSpec, seed: int) -> dict[str, list[dict]]:
    parts = split_by_group([r["group"] for r in rows], held_out(data), seed)
    return {name: [rows[i] for i in idx] for name, idx in parts.items()}


def builtin_data(spec: DataSpec, job: BuildContext, tokenizer, eval_max_length: int | None = None) -> DataBundle:
    """A built-in task's splits from JSONL; val and test are truncated to ``eval_max_length`` (``Spec.eval_max_length``;
    default ``data.max_length``)."""
    task = spec.task
    required = ("id", "group", "prompt", "response") if task == "causal-lm" else ("id", "group", "text", "label")
    if isinstance(spec.path, str):
        rows_by_split = _split_rows(read_jsonl(resolve_path(spec.path, job.folder), required), spec, job.seed)
        note = (f"split {spec.path} by group: val_fraction {spec.val_fraction}, "
                f"test_fraction {spec.test_fraction}, seed {job.seed}")
    else:
        rows_by_split = {k: read_jsonl(resolve_path(v, job.folder), required) for k, v in (spec.path or {}).items()}
        note = "splits given by data.path"
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; set one in its tokenizer_config.json (pad_token)")
    max_len = spec.max_length
    assert max_len is not None  # the spec requires data.max_length for built-in tasks
    eval_len = eval_max_length or max_len
    sets: dict[str, CausalLMDataset | ClassificationDataset]
    if task == "causal-lm":
        sets = {
            name: CausalLMDataset(rows, tokenizer, max_len if name == "train" else eval_len)
            for name, rows in rows_by_split.items()
        }
        names = None
        collate = PadCollate(tokenizer.pad_token_id, classification=False)
    else:
        names = class_names(rows_by_split, spec.labels)
        index = label_index(names, rows_by_split)
        sets = {
            name: ClassificationDataset(rows, tokenizer, max_len if name == "train" else eval_len, index)
            for name, rows in rows_by_split.items()
        }
        collate = PadCollate(tokenizer.pad_token_id, classification=True)
    return DataBundle(
        train=sets["train"],
        val=sets["val"],
        test=sets.get("test"),
        collate=collate,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        label_names=names,
        group_key="group",
        task=str(task),
        pad_batch=collate.pad_batch,
        notes=[note],
    )


def factory_data(spec: DataSpec, job: BuildContext) -> DataBundle:
    assert spec.factory is not None
    with factory_guard(f"importing data.factory {spec.factory!r}", job.factory_timeout):
        fn = import_factory(spec.factory, job.folder)
    with factory_guard(f"data.factory {spec.factory!r}", job.factory_timeout):
        out = fn(spec.factory_mapping())
    where = f"data.factory {spec.factory!r}"
    if not isinstance(out, dict):
        raise DataError(f"{where} returned {type(out).__name__}; expected a mapping with 'train', 'val' and 'collate'")
    unknown = set(out) - CONTRACT_KEYS
    if unknown:
        raise DataError(f"{where} returned unknown key(s) {sorted(unknown)}; "
                        f"the contract allows {sorted(CONTRACT_KEYS)}")
    if "collate" not in out or not callable(out["collate"]):
        raise DataError(f"{where} must return a callable 'collate' "
                        "(list of items -> batch dict of tensors with 'labels')")
    notes = []
    if "all" in out:
        if "train" in out or "val" in out:
            raise DataError(f"{where} returned 'all' together with 'train'/'val'; return one or the other")
        key = out.get("group_key")
        if not key:
            raise DataError(f"{where} returned 'all' without 'group_key'; "
                            "pilotrun splits by group and needs to know the field")
        whole = out["all"]
        groups = []
        for i in range(len(whole)):
            item = whole[i]
            if key not in item:
                raise DataError(f"{where}: item {i} of 'all' has no field {key!r} (the group_key)")
            groups.append(item[key])
        try:
            parts = split_by_group(groups, held_out(spec), job.seed)
        except TypeError as exc:
            raise DataError(f"{where}: the group_key {key!r} values cannot be compared ({exc})") from None
        train, val = IndexedSubset(whole, parts["train"]), IndexedSubset(whole, parts["val"])
        if "test" in parts:
            out["test"] = IndexedSubset(whole, parts["test"])
        notes.append(f"split 'all' by {key!r}: val_fraction {spec.val_fraction}, "
                     f"test_fraction {spec.test_fraction}, seed {job.seed}")
    else:
        for need in ("train", "val"):
            if need not in out:
                raise DataError(f"{where} returned no {need!r} split; "
                                "return 'train' and 'val', or 'all' with 'group_key'")
        train, val = out["train"], out["val"]
    for name, ds in (("train", train), ("val", val), ("test", out.get("test"))):
        if ds is None:
            continue
        if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
            raise DataError(f"{where}: {name!r} must be a map-style dataset (with __len__ and __getitem__)")
        if len(ds) == 0:
            raise DataError(f"{where}: the {name!r} split is empty")
        first = ds[0]
        if not isinstance(first, dict):
            raise DataError(f"{where}: item 0 of {name!r} is a {type(first).__name__}; "
                            "items must be dicts with an 'id'")
        if "id" not in first:
            raise DataError(f"{where}: item 0 of {name!r} has no 'id' (its keys: {sorted(first)[:10]}); "
                            "every item needs a unique 'id' so updates can be traced to examples")
    return DataBundle(
        train=train,
        val=val,
        test=out.get("test"),
        collate=out["collate"],
        decode=out.get("decode"),
        label_names=list(out["label_names"]) if out.get("label_names") is not None else None,
        group_key=out.get("group_key"),
        task="custom",
        notes=notes,
    )


def build_data(spec: DataSpec, job: BuildContext, tokenizer=None, eval_max_length: int | None = None) -> DataBundle:
    """The spec's ``data`` section as datasets: its factory's, or a built-in task's (tokenized with ``tokenizer``,
    val and test truncated to ``eval_max_length``). Paths and factory modules are found from ``job.folder``."""
    if spec.factory is not None:
        return factory_data(spec, job)
    return builtin_data(spec, job, tokenizer, eval_max_length)
