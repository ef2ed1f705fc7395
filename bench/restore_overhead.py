"""Restore cost of "verify once, use those bytes": pilotrun's admitted, pinned restore vs a plain ``torch.load``.

    .venv/bin/python bench/restore_overhead.py [--params 50e6] [--rounds 5]

One full training state (model, AdamW moments, scheduler, RNG) saved once by pilotrun. Timed, rounds alternating,
medians compared, from a warm page cache (a restore right after a save, as the pilot's restore gate runs):
- plain: ``torch.load(weights_only=True)`` of each shard and ``load_state_dict``, as a training script restores;
- admit: the loading policy's check alone (every file hashed against the manifest);
- pinned restore: ``restore_training_state`` (a private view whose files are the ones hashed, every file checked
  against the live objects, then loaded);
- admit + pinned restore: what ``run --resume`` and the restore worker do.
The ratio of the last to plain is what the second read (the view's) and the checks cost. Results go to
bench/results/ with the machine they ran on.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from _common import machine, write_results  # noqa: E402
from save_overhead import _State  # noqa: E402

from pilotrun.checkpoint.io import read_manifest  # noqa: E402
from pilotrun.checkpoint.saving import save_checkpoint  # noqa: E402
from pilotrun.checkpoint.state import restore_training_state  # noqa: E402
from pilotrun.checkpoint.trust import LoadPolicy  # noqa: E402


class _Fresh(_State):
    def load_state(self, state: dict) -> None:
        self.loaded = state


def plain(state: _State, folder: Path) -> float:
    t0 = time.perf_counter()
    names = sorted(read_manifest(folder)["files"])
    weights: dict = {}
    for name in (n for n in names if n.startswith("model-")):
        weights.update(torch.load(folder / name, map_location="cpu", weights_only=True)["entries"])
    state.model.load_state_dict(weights)
    for name in (n for n in names if n.startswith("optimizer-")):
        torch.load(folder / name, map_location="cpu", weights_only=True)
    return time.perf_counter() - t0


def admit(folder: Path, sha: str) -> float:
    t0 = time.perf_counter()
    LoadPolicy.of([sha]).admit(folder)
    return time.perf_counter() - t0


def pinned_restore(state: _State, folder: Path) -> float:
    t0 = time.perf_counter()
    restore_training_state(state, folder)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    saved = _State(int(args.params), torch.device("cpu"))
    root = Path(tempfile.mkdtemp())
    folder = root / "step-000001"
    written = save_checkpoint(folder, saved, {"bench": True})
    sha = str(written.manifest_sha256)
    fresh = _Fresh(int(args.params), torch.device("cpu"))
    runs: dict[str, list[float]] = {"plain": [], "admit": [], "pinned_restore": []}
    try:
        plain(fresh, folder)  # the page cache holds the files from here on, for every variant alike
        for _ in range(args.rounds):
            runs["plain"].append(plain(fresh, folder))
            runs["admit"].append(admit(folder, sha))
            runs["pinned_restore"].append(pinned_restore(fresh, folder))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    both = med["admit"] + med["pinned_restore"]
    size = written.total_bytes
    result = {"checkpoint_bytes": size, "files": len(written.files), "plain_torch_load_s": med["plain"],
              "admit_s": med["admit"], "pinned_restore_s": med["pinned_restore"], "admit_and_pinned_restore_s": both,
              "ratio_pinned_restore_vs_plain": med["pinned_restore"] / med["plain"],
              "ratio_admit_and_restore_vs_plain": both / med["plain"], "rounds": args.rounds, "runs_s": runs}
    mib = size / 2**20
    print(f"checkpoint {mib:.0f} MiB in {len(written.files)} files (warm page cache)")
    print(f"  plain torch.load + load_state_dict   {med['plain']:.3f} s")
    print(f"  admit (every file hashed)            {med['admit']:.3f} s")
    print(f"  pinned restore (view hashed, loaded) {med['pinned_restore']:.3f} s")
    print(f"  ratios: pinned restore vs plain {result['ratio_pinned_restore_vs_plain']:.2f} · admit + pinned "
          f"restore vs plain {result['ratio_admit_and_restore_vs_plain']:.2f}")
    write_results("restore_overhead", {"machine": machine(filesystem=tempfile.gettempdir()),
                                       "what": "admit + pinned restore vs plain torch.load", "result": result},
                  args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
