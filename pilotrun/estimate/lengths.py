"""The lengths a job's micro batches have, and an update's time at them (issue 42, item 5).

Memory is estimated at the longest batch and is never cut: the peak is the longest batch's. Time is not: pilotrun's
loop pads each micro batch to its longest example (``data.tasks.PadCollate``; only the pilot's gates pad to
``data.max_length``, to prove the worst case), so on data with mixed lengths most micro batches are shorter than the
trace, and an update at the longest length overstates a long job's hours.

* The lengths: for a built-in task, a bounded deterministic sample of the data file tokenized as pilotrun's datasets
  tokenize it (``CausalLMDataset`` / ``ClassificationDataset``, truncated to ``data.max_length``). A micro batch of
  ``b`` examples drawn from that distribution is as long as its longest: ``P(max <= x) = F(x) ** b``, exactly.
* The time: the traced micro batch's op table split into the attention kernels (SDPA / flash: FLOPs grow with the
  square of the length, bytes linearly) and the rest (linear in tokens), each op re-timed on the roofline at the
  scaled FLOPs and bytes, averaged over the batch-length distribution. Weights are read and gradients written
  whatever the length: a micro batch never takes less than that traffic at the memory bandwidth (the floor).

Where the lengths or the split are not known the time stays at the longest length and the row says why.

Example::

    lengths = data_lengths(spec)                         # DataLengths: basis, histogram, sample size
    batch_length_distribution(lengths.histogram, 8)      # [(length, probability), ...] of an 8-example micro batch
"""
from __future__ import annotations

import array
import hashlib
import json
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..safefile import FileProblem, WriteFailed, read_json, write_atomic
from .catalog import Accelerator
from .ops import roofline_seconds

DATA_FILE, LONGEST = "data file", "longest"
PAD_TO_LONGEST = "pad to longest in micro batch"
SAMPLE = 2000      # examples tokenized: a bounded cost on a file of any size, plenty for a length distribution
FORMAT = 1         # bump when DataLengths' fields change meaning (the cached entries are then other keys)
# A model's embedding is padded past its tokenizer's vocabulary by a few percent at most (to a multiple of 64 or
# 128); a tokenizer under half of it belongs to another model (a placeholder beside an estimate-only spec).
OWN_TOKENIZER_SHARE = 0.5


@dataclass(frozen=True)
class DataLengths:
    """Where the lengths come from and, for a data file, the sampled examples' token counts after truncation."""

    basis: str                                   # DATA_FILE or LONGEST
    reason: str                                  # for LONGEST: why the data's lengths are not known
    histogram: tuple[tuple[int, int], ...] = ()  # (tokens, examples), ascending
    sampled_examples: int = 0
    examples: int = 0                            # non-empty lines in the file sampled
    source: str = ""                             # the file, as the spec names it
    collate: str | None = None

    def to_dict(self) -> dict:
        return {"basis": self.basis, "reason": self.reason, "histogram": [list(h) for h in self.histogram],
                "sampled_examples": self.sampled_examples, "examples": self.examples, "source": self.source,
                "collate": self.collate}

    @classmethod
    def from_dict(cls, d: dict) -> DataLengths:
        return cls(str(d["basis"]), str(d["reason"]), tuple((int(a), int(b)) for a, b in d["histogram"]),
                   int(d["sampled_examples"]), int(d["examples"]), str(d["source"]), d.get("collate"))


def longest(reason: str) -> DataLengths:
    return DataLengths(LONGEST, reason)


# ------------------------------------------------------------------------------------------- the batch lengths


def batch_length_distribution(histogram, draws: float) -> list[tuple[int, float]]:
    """[(length, probability)] of the longest of ``draws`` examples drawn from ``histogram`` ((length, count) pairs):
    ``P(max <= x_k) = F(x_k) ** draws``. Drawn with replacement: the loop's shuffled epoch draws without, which
    differs only when a micro batch is a sizeable share of the data. ``draws`` may be fractional (a micro scale)."""
    pairs = sorted((int(n), int(c)) for n, c in histogram if c > 0)
    total = sum(c for _, c in pairs)
    if not total:
        return []
    out, seen, below = [], 0, 0.0
    for length, count in pairs:
        seen += count
        upto = (seen / total) ** max(draws, 1e-9)
        out.append((length, upto - below))
        below = upto
    return [(n, p) for n, p in out if p > 0]


def mean_length(dist: list[tuple[int, float]]) -> float:
    return sum(n * p for n, p in dist)


# ------------------------------------------------------------------------------------------------ the time split


def split_ops(ops: list[list], attention_ops: list[list]) -> tuple[list[list], list[list]] | None:
    """(rows linear in tokens, attention rows) of a micro batch's op table; None when the attention rows are not all
    in the table (a trace from elsewhere: the split cannot be trusted)."""
    left = Counter({(d, f, b): n for d, f, b, n in ops})
    for d, f, b, n in attention_ops:
        if left[(d, f, b)] < n:
            return None
        left[(d, f, b)] -= n
    return [[d, f, b, n] for (d, f, b), n in left.items() if n], [list(r) for r in attention_ops]


def micro_seconds_at(linear: dict, quadratic: list[list], ratio: float, acc: Accelerator, compute_eff: float,
                     bandwidth_eff: float, floor: float = 0.0) -> tuple[float, float]:
    """(seconds, memory-bound seconds) of one micro batch at ``ratio`` of the traced length: the linear ops'
    roofline (``linear``, at the traced length) x ratio, each attention op at ratio**2 its FLOPs and ratio its bytes,
    and never below ``floor``."""
    q = roofline_seconds([[d, f * ratio * ratio, b * ratio, n] for d, f, b, n in quadratic], acc, compute_eff,
                         bandwidth_eff)
    seconds = linear["seconds"] * ratio + (q["seconds"] or 0.0)
    memory = linear["memory_bound_seconds"] * ratio + q["memory_bound_seconds"]
    if seconds < floor:
        return floor, floor
    return seconds, memory


@dataclass
class AtLengths:
    """An update's micro batch at the data's lengths: the factors to apply to the traced one, and what the row says."""

    view: dict                       # the row's time_lengths
    seconds: float | None = None     # expected seconds of one micro batch (None: stay at the traced)
    memory_bound_seconds: float = 0.0
    time_factor: float = 1.0         # expected / traced seconds of a micro batch
    flops_factor: float = 1.0        # expected / traced FLOPs of a micro batch


def at_longest(traced: int, reason: str) -> AtLengths:
    return AtLengths({"basis": LONGEST, "longest": traced or None, "mean_batch_length": traced or None,
                      "sampled_examples": 0, "collate": None, "time_factor": 1.0,
                      "note": f"time at the longest length{f' ({traced})' if traced else ''}: {reason}"})


def separable(trace: dict, step: dict) -> tuple[tuple[list[list], list[list]] | None, str]:
    """The (linear, attention) split of the traced micro batch, or None and why it cannot be made."""
    att = trace.get("attention") or {}
    if not step.get("ops"):
        return None, "the trace has no per-op costs (trace again with --no-trace-cache)"
    if "attention_ops" not in step:
        return None, ("the trace does not keep the attention kernels' costs apart (written before it did: trace "
                      "again with --no-trace-cache)")
    if att.get("implementation") == "eager" or not att.get("calls") or not step["attention_ops"]:
        return None, ("the trace cannot tell the attention's L x L ops from the rest (eager attention, or attention "
                      "computed with the model's own ops)")
    split = split_ops(step["ops"], step["attention_ops"])
    return split, "" if split else "the attention kernels' rows are not in the op table"


def expected_micro(trace: dict, step: dict, acc: Accelerator, eff, lengths: DataLengths, draws: float,
                   ranks: tuple[int, bool]) -> AtLengths:
    """One micro batch's expected time at ``lengths``: ``draws`` examples per rank, ``ranks`` (how many run each
    micro batch in step, whether they meet every layer) each waiting for the longest of them."""
    traced = int(step.get("seq_len") or 0)
    if lengths.basis != DATA_FILE:
        return at_longest(traced, lengths.reason)
    if not traced:
        return at_longest(traced, "the traced batch has no sequence length")
    split, why = separable(trace, step)
    if split is None:
        return at_longest(traced, why)
    linear_rows, quadratic = split
    linear = roofline_seconds(linear_rows, acc, eff.compute, eff.bandwidth)
    full = roofline_seconds(step["ops"], acc, eff.compute, eff.bandwidth)
    if linear["seconds"] is None or full["seconds"] is None or not full["seconds"]:
        return at_longest(traced, linear.get("reason") or full.get("reason") or "the traced micro batch takes no time")
    # Weights read in forward and backward and gradients written by each micro batch, whatever its length.
    floor = min(full["seconds"], (2 * trace.get("parameter_bytes", 0) + trace.get("gradient_bytes", 0))
                / (acc.bandwidth_tb_s * 1e12 * eff.bandwidth))
    gpus, gathers = ranks
    dist = batch_length_distribution(lengths.histogram, draws * gpus)
    seconds = memory = flops = 0.0
    quad_flops = sum(f * n for _, f, _, n in quadratic)
    for length, p in dist:
        r = min(1.0, length / traced)
        s, m = micro_seconds_at(linear, quadratic, r, acc, eff.compute, eff.bandwidth, floor)
        seconds, memory = seconds + p * s, memory + p * m
        flops += p * ((full["flops"] - quad_flops) * r + quad_flops * r * r)
    mean = mean_length(dist)
    q_share = (full["seconds"] - linear["seconds"]) / full["seconds"]
    view = {"basis": DATA_FILE, "collate": lengths.collate, "longest": traced,
            "mean_batch_length": round(min(mean, traced), 1), "sampled_examples": lengths.sampled_examples,
            "examples": lengths.examples, "source": lengths.source, "ranks_in_step": gpus,
            "micro_batch": int(draws) if draws == int(draws) else round(draws, 3),
            "attention_share": round(q_share, 4), "time_factor": round(seconds / full["seconds"], 4),
            "floor_seconds": floor}
    step_note = ("" if gpus == 1 else f"; each micro batch waits for the longest of {gpus} ranks'" +
                 ("" if gathers else " (an upper bound: data-parallel ranks meet only at the window's end)"))
    view["note"] = (f"time at the data's lengths: {lengths.collate}, {mean:.0f} tokens on average (the longest, "
                    f"{traced}, traced), from {lengths.sampled_examples} of {lengths.examples} examples of "
                    f"{lengths.source}; attention {q_share:.0%} of a micro batch at the longest, scaled with the "
                    f"square of the length, the rest linearly, never below the weights' traffic{step_note}; memory "
                    "stays at the longest")
    return AtLengths(view, seconds, memory, seconds / full["seconds"],
                     flops / full["flops"] if full["flops"] else 1.0)


# ------------------------------------------------------------------------------------------- reading the data


def data_lengths(spec, cache_dir: Path | None = None, sample: int = SAMPLE) -> DataLengths:
    """The lengths pilotrun's loop gives the spec's training examples (see the module's docstring), or LONGEST with
    why they are not known. ``cache_dir``: where answers are kept, keyed by the file's and tokenizer's stamps (the
    tokenizer alone takes seconds to import and load)."""
    from ..drivers.build import driver_class  # here: reading cached lengths imports no torch

    d = spec.data
    if not driver_class(spec).in_process:  # the job's batches are made outside pilotrun, by the program
        return longest("the program's own collate makes its batches, and its describe run stops before the first "
                       "batch: the data's lengths are not known")
    if d.factory is not None:
        return longest("a data factory's items and collate are the user's: the data's lengths are not known")
    if d.task not in ("causal-lm", "seq-classification"):
        return longest(f"data.task {d.task} is a shape for the estimate, with no data file: the data's lengths are "
                       "not known")
    named = d.path if isinstance(d.path, str) else (d.path or {}).get("train")
    if not named:
        return longest("no data.path: the data's lengths are not known")
    try:
        path = spec.resolve(named)
    except OSError as exc:
        return longest(f"data.path {named}: {exc}")
    if not path.is_file():
        return longest(f"data.path {named} is not on this machine: the data's lengths are not known")
    key = _cache_key(spec, path, sample)
    if cache_dir is not None and (hit := _cached(cache_dir, key)) is not None:
        return hit
    found = _measure(spec, path, named, sample)
    if cache_dir is not None:
        _store(cache_dir, key, found)
    return found


def _measure(spec, path: Path, named: str, sample: int) -> DataLengths:
    from ..models.loading import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec.model, spec.folder)
    except Exception as exc:   # a tokenizer not on this machine: the estimate still answers, at the longest
        return longest(f"the tokenizer could not be loaded ({type(exc).__name__}: {exc}): the data's lengths are "
                       "not known")
    if tokenizer is None:
        return longest("no tokenizer (model.tokenizer or model.hf): the data's lengths are not known")
    if (why := vocabulary_problem(len(tokenizer), _model_vocab(spec))) is not None:
        return longest(why)
    required = ("id", "group", "prompt", "response") if spec.data.task == "causal-lm" else ("id", "group", "text",
                                                                                           "label")
    try:
        lines, total = sample_lines(path, sample, spec.seed)
    except OSError as exc:
        return longest(f"data.path {named}: {exc.strerror or exc}")
    rows = parse_rows(lines, required, named)
    if isinstance(rows, str):
        return longest(f"{rows}: the data's lengths are not known (`pilotrun run` names the fix)")
    if not rows:
        return longest(f"data.path {named} has no rows")
    counts = tokenized_lengths(str(spec.data.task), rows, tokenizer, int(spec.data.max_length))
    return DataLengths(DATA_FILE, "", tuple(sorted(counts.items())), len(rows), total, named, PAD_TO_LONGEST)


def _model_vocab(spec) -> int | None:
    """The model's embedding rows: its config's vocab_size (a Hub model's from the local cache only); None unknown."""
    m = spec.model
    if m.config is not None:
        v = m.config.get("vocab_size")
        return int(v) if isinstance(v, int) else None
    if m.hf is None:
        return None
    try:
        from transformers import AutoConfig

        local = spec.resolve(m.hf)
        where = str(local) if local.exists() else m.hf
        v = getattr(AutoConfig.from_pretrained(where, revision=m.revision, local_files_only=True), "vocab_size", None)
    except Exception:   # not in the local cache, remote code: the check is skipped, never a download
        return None
    return int(v) if isinstance(v, int) else None


def _stamp(path: Path) -> dict:
    try:
        if path.is_dir():
            return {p.name: _stamp(p) for p in sorted(path.iterdir())[:50] if p.is_file()}
        st = path.stat()
    except OSError:
        return {"missing": True}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cache_key(spec, path: Path, sample: int) -> dict:
    tok = spec.model.tokenizer or spec.model.hf
    try:
        tok_path = spec.resolve(tok) if tok else None
    except OSError:
        tok_path = None
    return {"format": FORMAT, "file": str(path), "stamp": _stamp(path), "model": spec.canonical()["model"],
            "tokenizer": _stamp(tok_path) if tok_path is not None and tok_path.exists() else tok,
            "task": spec.data.task, "max_length": spec.data.max_length, "sample": sample, "seed": spec.seed}


def _entry(cache_dir: Path, key: dict) -> Path:
    return cache_dir / (hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
                        + ".json")


def _cached(cache_dir: Path, key: dict) -> DataLengths | None:
    try:
        entry = read_json(_entry(cache_dir, key), 16 << 20)
        if entry.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        return DataLengths.from_dict(entry["lengths"])
    except (FileProblem, AttributeError, KeyError, TypeError, ValueError):   # missing or damaged: measured again
        return None


def _store(cache_dir: Path, key: dict, lengths: DataLengths) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(_entry(cache_dir, key), json.dumps({"key": key, "lengths": lengths.to_dict()}, default=str))
    except (OSError, WriteFailed):   # a cache that cannot be written costs the next estimate a second, nothing more
        pass


def vocabulary_problem(tokenizer_size: int, model_vocab: int | None) -> str | None:
    """Why the tokenizer's token counts are not this model's, or None."""
    if not model_vocab:
        return None
    if tokenizer_size > model_vocab:
        return (f"the tokenizer makes {tokenizer_size} ids and the model embeds {model_vocab}: it is not this model's, "
                "so its token counts are not this job's lengths")
    if tokenizer_size < OWN_TOKENIZER_SHARE * model_vocab:
        return (f"the tokenizer's {tokenizer_size} ids are far fewer than the model's {model_vocab} embedding rows: it "
                "is another model's (a placeholder), so its token counts are not this job's lengths")
    return None


def sample_lines(path: Path, sample: int, seed: int) -> tuple[list[tuple[int, str]], int]:
    """([(line number, text)] of a deterministic sample of ``sample`` non-empty lines, the number of non-empty
    lines): one pass for the offsets, then only the sampled lines are read."""
    offsets = array.array("q")
    numbers = array.array("q")
    with open(path, "rb") as fh:
        pos = 0
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                offsets.append(pos)
                numbers.append(lineno)
            pos += len(raw)
        n = len(offsets)
        chosen = range(n) if n <= sample else sorted(random.Random(seed).sample(range(n), sample))
        out = []
        for i in chosen:
            fh.seek(offsets[i])
            out.append((numbers[i], fh.readline().decode("utf-8", errors="replace")))
    return out, n


def tokenized_lengths(task: str, rows: list[dict], tokenizer, max_length: int) -> Counter:
    """Token counts of ``rows`` as pilotrun's built-in datasets make them (truncated to ``max_length``)."""
    from ..data.tasks import CausalLMDataset, ClassificationDataset

    if task == "causal-lm":
        items = CausalLMDataset(rows, tokenizer, max_length).items
    else:   # the label's index does not change a length
        items = ClassificationDataset(rows, tokenizer, max_length, defaultdict(int)).items
    return Counter(len(ids) for it in items if isinstance(ids := it["input_ids"], list))


def parse_rows(lines: list[tuple[int, str]], required: tuple[str, ...], source: str) -> list[dict] | str:
    """The sampled lines as rows, or what is wrong with the first bad one (file:line and the fix)."""
    rows = []
    for lineno, text in lines:
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"{source}:{lineno} is not valid JSON ({exc.msg})"
        if not isinstance(row, dict) or any(k not in row for k in required):
            return f"{source}:{lineno} lacks {', '.join(required)}"
        rows.append(row)
    return rows
