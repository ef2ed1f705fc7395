"""The accelerator catalog: a YAML table shipped with pilotrun, extended or overridden by the user's.

An accelerator that is in neither is unknown — never guessed.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Efficiency:
    compute: float     # share of the dense peak of an op's dtype a matmul-class kernel reaches
    bandwidth: float   # share of the datasheet memory bandwidth a memory-bound kernel reaches
    source: str        # where the two came from


class CatalogError(Exception):
    """An unknown accelerator or an unreadable catalog file; the message lists what is known."""


@dataclass(frozen=True)
class Accelerator:
    name: str
    vendor: str
    stack: str                       # cuda or rocm
    memory_bytes: int                # as the runtime reports it
    memory_spec_gb: float
    bandwidth_tb_s: float
    peak_tflops: dict
    interconnect: dict
    context_bytes: int
    blas_workspace_bytes: int
    nccl_buffer_bytes: int
    notes: str = ""
    price_per_gpu_hour: float | None = None
    spot_price_per_gpu_hour: float | None = None  # preemptible (spot) capacity; None: not known
    skypilot: str = ""               # SkyPilot's name for it (resources.accelerators); "" when not known
    compute_capability: str = ""
    aliases: tuple = ()
    defaults: dict = field(default_factory=dict)
    # {compute, bandwidth, source}: the shares of the dense peak and of the datasheet bandwidth this accelerator's
    # kernels reach in a training step, where a published measurement gives them; else the catalog defaults.
    efficiency: dict = field(default_factory=dict)
    # {bf16: TFLOPS, source}: the best-shape bf16 matmul rate measured on this accelerator (Maximum Achievable Matmul
    # FLOPS); the compute efficiency is then defaults.share_of_mamf of it over the dense peak, not the flat default.
    mamf: dict = field(default_factory=dict)
    # {link_gb_s, memory_gb, memory_bandwidth_gb_s}: the host side, for CPU offload. link_gb_s is the GPU's host link
    # per direction (its datasheet); the node's memory and memory bandwidth depend on the rental, so null built in.
    host: dict = field(default_factory=dict)

    def host_figure(self, key: str) -> float | None:
        """One of ``host``'s figures as a number (GB/s or GB), None where the catalog does not know it."""
        value = self.host.get(key)
        return None if value is None else float(value)

    def cost(self, hours: float | None, gpus: int) -> float | None:
        """What ``hours`` on ``gpus`` of these cost at the catalog's price; None without a price or a time."""
        if hours is None or self.price_per_gpu_hour is None:
            return None
        return hours * gpus * self.price_per_gpu_hour

    def price_note(self) -> str | None:
        """Why no cost is shown, and how to get one."""
        if self.price_per_gpu_hour is not None:
            return None
        return (f"no price for {self.name}: add price_per_gpu_hour under accelerators.{self.name} in a catalog file "
                "and pass --catalog (docs/catalog.md)")

    def efficiencies(self) -> Efficiency:
        """The time model's shares of the peak and of the bandwidth (model.seconds_per_update), and their source."""
        own = self.efficiency
        if own:
            return Efficiency(float(own["compute"]), float(own["bandwidth"]), str(own.get("source", "")))
        bandwidth = float(self.defaults.get("bandwidth_efficiency", DEFAULT_BANDWIDTH_EFFICIENCY))
        measured, peak = self.mamf.get("bf16"), self.peak_flops("bf16")
        share = self.defaults.get("share_of_mamf", DEFAULT_SHARE_OF_MAMF)
        if measured and peak and share is not None:
            # Accelerators differ in how close a matmul gets to the datasheet: a flat share of it made an H100 (80% at
            # its best shape) and an MI300X (51%) as efficient as an A100 (87%).
            share = float(share)
            best = float(measured) * 1e12 / peak
            return Efficiency(share * best, bandwidth,
                              f"matmuls at {share:.0%} of {self.name}'s measured best-shape bf16 rate "
                              f"({float(measured):g} TFLOPS, {best:.1%} of its peak: "
                              f"{self.mamf.get('source', 'unsourced')}); memory at the catalog's default share of its "
                              "bandwidth (docs/catalog.md)")
        return Efficiency(float(self.defaults.get("compute_efficiency", DEFAULT_COMPUTE_EFFICIENCY)), bandwidth,
                          "the catalog's default efficiencies (docs/catalog.md)")

    def peak_flops(self, precision: str) -> float | None:
        tf = self.peak_tflops.get(PEAK_OF_PRECISION.get(precision, precision))
        return None if tf is None else float(tf) * 1e12


# A train.precision whose matmuls run in another precision's peak: bf16-true (and bf16-true-autocast) hold bf16
# weights and multiply in bf16 (the catalog has no "bf16-true" peak, so every bf16-true row showed no time).
PEAK_OF_PRECISION = {"bf16-true": "bf16", "bf16-true-autocast": "bf16"}

REQUIRED = ("vendor", "stack", "memory_bytes", "bandwidth_tb_s", "peak_tflops", "interconnect", "context_bytes",
            "blas_workspace_bytes", "nccl_buffer_bytes")
# Every key an entry may have (docs/catalog.md describes each); a misspelt key is an error, not ignored: a
# silently dropped "price_per_hour" would leave every cost blank with no reason given.
OPTIONAL = ("aliases", "compute_capability", "memory_spec_gb", "notes", "price_per_gpu_hour", "spot_price_per_gpu_hour",
            "skypilot", "efficiency", "host", "mamf")
PRICE_KEYS = ("price_per_gpu_hour", "spot_price_per_gpu_hour")
HOST_KEYS = ("link_gb_s", "memory_gb", "memory_bandwidth_gb_s")
DEFAULT_KEYS = ("reserved_margin", "utilisation", "headroom", "compute_efficiency", "bandwidth_efficiency",
                "share_of_mamf")
# Used when the catalog's defaults lack them (a user catalog written before the time model); catalog.yaml says why.
DEFAULT_COMPUTE_EFFICIENCY = 0.7
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
DEFAULT_SHARE_OF_MAMF = 0.8


def _read(path: Path | None) -> dict:
    if path is None:
        text = resources.files("pilotrun.estimate").joinpath("catalog.yaml").read_text()
        where = "the built-in catalog"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CatalogError(f"cannot read catalog {path}: {exc.strerror}") from None
        where = str(path)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise CatalogError(f"{where} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("accelerators", {}), dict):
        raise CatalogError(f"{where}: expected a mapping with 'accelerators'")
    return data


def load_catalog(user: Path | None = None) -> dict[str, Accelerator]:
    """Built-in entries, then the user's: a user entry with a known name overrides fields, a new one is added."""
    base = _read(None)
    defaults = dict(base.get("defaults", {}))
    entries = copy.deepcopy(base["accelerators"])
    if user is not None:
        extra = _read(user)
        own = extra.get("defaults", {}) or {}
        defaults.update(own)
        if "compute_efficiency" in own and "share_of_mamf" not in own:
            # The user's own flat efficiency is meant for every accelerator, the measured ones too.
            defaults["share_of_mamf"] = None
        for name, fields in (extra.get("accelerators") or {}).items():
            fields = fields or {}
            merged = {**entries.get(name, {}), **fields}
            if "peak_tflops" in fields and "mamf" not in fields:
                merged.pop("mamf", None)   # a built-in measured rate is a share of the built-in peak, not of theirs
            entries[name] = merged
    unknown_defaults = sorted(set(defaults) - set(DEFAULT_KEYS))
    if unknown_defaults:
        raise CatalogError(f"{user or 'the built-in catalog'}: unknown key(s) under defaults: "
                           f"{', '.join(unknown_defaults)}; known: {', '.join(DEFAULT_KEYS)} (docs/catalog.md)")
    share_of_mamf = defaults.get("share_of_mamf")
    if share_of_mamf is not None and not (isinstance(share_of_mamf, (int, float)) and not isinstance(
            share_of_mamf, bool) and 0 < share_of_mamf <= 1):
        raise CatalogError(f"{user or 'the built-in catalog'}: defaults.share_of_mamf must be a share in (0, 1], e.g. "
                           f"0.8, or null to use compute_efficiency everywhere; got {share_of_mamf!r}")
    out = {}
    for name, f in entries.items():
        missing = [k for k in REQUIRED if f.get(k) is None]
        if missing:
            raise CatalogError(f"catalog entry {name!r} lacks {', '.join(missing)} (docs/catalog.md lists every key)")
        unknown = sorted(set(f) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise CatalogError(f"catalog entry {name!r} has unknown key(s) {', '.join(unknown)}; known: "
                               f"{', '.join(REQUIRED + OPTIONAL)} (docs/catalog.md)")
        for key in PRICE_KEYS:
            price = f.get(key)
            if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0):
                raise CatalogError(f"catalog entry {name!r}: {key} must be a number of your currency "
                                   f"per GPU per hour, e.g. 2.49; got {price!r}")
        price, spot = f.get("price_per_gpu_hour"), f.get("spot_price_per_gpu_hour")
        link = f["interconnect"] if isinstance(f["interconnect"], dict) else None
        bad_link = ("interconnect must be a mapping" if link is None else next(
            (f"interconnect.{k} must be a number >= 0 (GB/s per GPU), e.g. 50; got {link[k]!r}"
             for k in ("per_gpu_gb_s", "inter_node_gb_s") if link.get(k) is not None
             and (isinstance(link[k], bool) or not isinstance(link[k], (int, float)) or link[k] < 0)), None))
        if bad_link:
            raise CatalogError(f"catalog entry {name!r}: {bad_link}")
        eff = f.get("efficiency") or {}
        share = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1)  # noqa: E731
        if eff and not (isinstance(eff, dict) and all(share(eff.get(k)) for k in ("compute", "bandwidth"))):
            raise CatalogError(f"catalog entry {name!r}: efficiency takes compute and bandwidth, each a share in "
                               "(0, 1], and its source, e.g. {compute: 0.7, bandwidth: 0.8, source: ...}; "
                               f"got {eff!r}")
        mamf = f.get("mamf") or {}
        bad_mamf = _mamf_problem(mamf, f["peak_tflops"])
        if bad_mamf:
            raise CatalogError(f"catalog entry {name!r}: {bad_mamf}")
        bad_host = _host_problem(f.get("host"))
        if bad_host:
            raise CatalogError(f"catalog entry {name!r}: {bad_host}")
        sky_name = f.get("skypilot", "")
        if not isinstance(sky_name, str) or (sky_name and not re.fullmatch(r"[A-Za-z0-9][\w.-]*", sky_name)):
            raise CatalogError(f"catalog entry {name!r}: skypilot is SkyPilot's accelerator name as `sky show-gpus` "
                               f"prints it, e.g. H100; got {sky_name!r}")
        out[name] = Accelerator(
            name=name, vendor=f["vendor"], stack=f["stack"], memory_bytes=int(f["memory_bytes"]),
            memory_spec_gb=float(f.get("memory_spec_gb", 0)), bandwidth_tb_s=float(f["bandwidth_tb_s"]),
            peak_tflops=dict(f["peak_tflops"]), interconnect=dict(f["interconnect"]),
            context_bytes=int(f["context_bytes"]), blas_workspace_bytes=int(f["blas_workspace_bytes"]),
            nccl_buffer_bytes=int(f["nccl_buffer_bytes"]), notes=str(f.get("notes", "")),
            price_per_gpu_hour=None if price is None else float(price),
            spot_price_per_gpu_hour=None if spot is None else float(spot), skypilot=sky_name,
            compute_capability=str(f.get("compute_capability", "")),
            aliases=tuple(f.get("aliases", [])), defaults=defaults, efficiency=dict(eff),
            host=dict(f.get("host") or {}), mamf=dict(mamf),
        )
    return out


def _mamf_problem(mamf, peak_tflops) -> str | None:
    """What is wrong with an entry's ``mamf`` mapping, or None (absent is fine: the flat default applies)."""
    if not mamf:
        return None
    peak = peak_tflops.get("bf16") if isinstance(peak_tflops, dict) else None
    rate = mamf.get("bf16") if isinstance(mamf, dict) else None
    in_range = (isinstance(rate, (int, float)) and not isinstance(rate, bool) and isinstance(peak, (int, float))
                and 0 < rate <= peak)
    if not (in_range and isinstance(mamf.get("source"), str) and mamf["source"]):
        return ("mamf takes bf16, the best-shape bf16 matmul TFLOPS measured on it (above 0, at most its "
                f"peak_tflops.bf16, {peak}), and the source of that measurement, e.g. {{bf16: 794.5, source: "
                f"\"...\"}}, or mamf: null for none; got {mamf!r}")
    return None


def _host_problem(host) -> str | None:
    """What is wrong with an entry's ``host`` mapping, or None (absent is fine: every figure unknown)."""
    if host is None:
        return None
    if not isinstance(host, dict):
        return f"host must be a mapping of {', '.join(HOST_KEYS)}, e.g. {{link_gb_s: 64}}; got {host!r}"
    unknown = sorted(set(host) - set(HOST_KEYS))
    if unknown:
        return f"host has unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(HOST_KEYS)}"
    for key, value in host.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            return f"host.{key} must be a positive number (GB/s or GB) or null for unknown; got {value!r}"
    return None


def find(catalog: dict[str, Accelerator], name: str) -> Accelerator:
    """By name or alias, case-insensitively; unknown names are an error that lists the known ones."""
    key = name.strip().lower()
    for acc in catalog.values():
        if key == acc.name.lower() or key in (a.lower() for a in acc.aliases):
            return acc
    known = ", ".join(sorted(catalog))
    raise CatalogError(f"unknown accelerator {name!r}; known: {known} (add it to a catalog file and pass --catalog)")


def _contains_name(text: str, name: str) -> bool:
    """``name`` inside ``text`` as whole words: "nvidia l4" is not in "nvidia l40s"."""
    return re.search(r"(?<![\w.-])" + re.escape(name) + r"(?![\w.-])", text) is not None


def matches(acc: Accelerator, device_name: str | None) -> bool:
    """Whether a device's reported name ("NVIDIA H100 80GB HBM3") is this catalog entry. Names match as
    whole words, so the L4's "NVIDIA L4" does not claim an "NVIDIA L40S" (a plain substring test did)."""
    if not device_name:
        return False
    name = device_name.lower()
    return _contains_name(name, acc.name.lower()) or any(
        a.lower() == name or (len(a) > 4 and _contains_name(name, a.lower())) for a in acc.aliases)


def local_accelerator(catalog: dict[str, Accelerator], device_index: int = 0) -> Accelerator | None:
    """The accelerator this process runs on: its catalog entry, or one built from what the device reports
    (capacity known, peaks unknown: no time estimate). None without an accelerator."""
    from ..devices import query_devices

    inv = query_devices()
    if not inv.runtime.indexed or device_index >= inv.count:
        return None
    name = inv.names[device_index]
    for acc in catalog.values():
        if matches(acc, name):
            return acc
    base = next(iter(catalog.values()))
    return Accelerator(name=name, vendor="unknown", stack=inv.backend,
                       memory_bytes=inv.total_memory_bytes[device_index], memory_spec_gb=0, bandwidth_tb_s=0,
                       peak_tflops={}, interconnect={}, context_bytes=base.context_bytes,
                       blas_workspace_bytes=base.blas_workspace_bytes, nccl_buffer_bytes=base.nccl_buffer_bytes,
                       notes="not in the catalog: capacity as the device reports it, peaks unknown",
                       defaults=base.defaults)
