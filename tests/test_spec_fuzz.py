"""A spec fuzzer: every mutated spec, flag or environment gets exit 2 naming what is wrong, in bounded time.

Hundreds of cases run in this process through the command line's own entry point (``pilotrun.cli.main``),
each under an interval timer; a handful run as real ``pilotrun`` subprocesses (files that block when
opened, environment variables, user code that ends the process). Each case is marked invalid (it must
exit 2) or maybe-valid (a mutation the spec accepts: exit 0 or 2). Across all of them: no traceback,
no hang, no exit 0 or 1 on an invalid spec, no exit 3.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
import yaml

from pilotrun.cli import main

from .conftest import EXAMPLES, TEST_DIGEST, copy_fixture

CASE_SECONDS = 20  # one case's limit: a bound, not a measurement (a case takes milliseconds)
SEED = 12          # the mutations are random but reproducible

INVALID, MAYBE = "invalid", "maybe-valid"

TOY = {"name": "toy", "seed": 3,
       "model": {"factory": "toy:build_model", "vocab": 64, "dim": 32, "classes": 3},
       "data": {"factory": "toy:build_data", "examples": 96},
       "train": {"micro_batch_size": 4, "grad_accum_steps": 2, "updates": 50,
                 "optimizer": {"name": "adamw", "lr": 0.01}},
       "eval": {"batch_size": 8}, "pilot": {"updates": 4}}
CONFIG = {"name": "cfg", "seed": 0,
          "model": {"config": {"model_type": "llama", "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2},
                    "tokenizer": "tokenizer"},
          "data": {"task": "causal-lm", "path": "data.jsonl", "max_length": 32},
          "train": {"micro_batch_size": 2, "updates": 10, "optimizer": {"lr": 1e-3}}}

# Integer fields and values outside what each accepts (schema checks and config/limits.py).
INT_FIELDS = ["seed", "train.micro_batch_size", "train.grad_accum_steps", "train.updates", "eval.batch_size",
              "eval.max_batches", "pilot.updates", "pilot.overfit.examples", "pilot.overfit.max_updates",
              "pilot.resume.before", "pilot.resume.after", "pilot.inspect.examples", "data.num_workers",
              "train.scheduler.warmup_updates"]
# Fields whose range reaches past 2**31 (numpy's seeds; schedule lengths): the other fields end far below it.
WIDE = {"seed": 2**32 - 1, "train.updates": 2**53, "train.scheduler.warmup_updates": 2**53}
BAD_INTS = [-1, -(2**31), 2**31, 2**32, 2**63, 2**64, 10**30]
WRONG_TYPES = ["abc", [1, 2], {"a": 1}, True, 1.5, None, ".nan", "", [], {}]
BAD_SET_VALUES = ["[1,", "[red]x", "{a: 1", "!!python/object/apply:os.system ['true']", "!!python/name:os.system",
                  "a: b: c", "'unterminated", "*undefined_alias", "&a [*a]", "\t[", "x" * 20_000]


@dataclass
class Case:
    name: str
    expect: str
    text: str | bytes | None = None          # the spec file's content (None: argv names an existing path)
    base: str = "toy"                        # the folder the spec is written into
    argv: list[str] = field(default_factory=list)
    spec_path: str | None = None             # a path used as the spec instead of a written file


def _dump(spec: dict) -> str:
    return yaml.safe_dump(spec, sort_keys=False)


def _set(spec: dict, dotted: str, value) -> dict:
    out = yaml.safe_load(_dump(spec))
    node = out
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def cases() -> list[Case]:
    rng = random.Random(SEED)
    out: list[Case] = []
    for f in INT_FIELDS:  # ranges
        for v in BAD_INTS:
            if 0 <= v <= WIDE.get(f, -1):
                continue
            out.append(Case(f"range {f}={v}", INVALID, _dump(_set(TOY, f, v))))
    for f in INT_FIELDS + ["name", "train.optimizer.lr", "train.precision", "data.val_fraction",
                           "train.max_grad_norm", "model", "data", "train", "pilot", "eval", "distributed"]:
        for v in rng.sample(WRONG_TYPES, 5):  # types
            valid_null = v is None and f in ("train.max_grad_norm", "eval.batch_size", "eval.max_batches")
            if valid_null or (f in ("pilot", "eval", "distributed") and v == {}):
                continue
            out.append(Case(f"type {f}={v!r}", INVALID, _dump(_set(TOY, f, v))))
    for layers in (2**31, 10**6, -1):  # layer counts of a model config
        out.append(Case(f"layers {layers}", INVALID, _dump(_set(CONFIG, "model.config.num_hidden_layers", layers)),
                        base="cfg"))
    for v in ({"a": 1}, ["llama"], 3, None, True, "no-such-arch"):  # model_type of the wrong type
        out.append(Case(f"model_type {v!r}", INVALID, _dump(_set(CONFIG, "model.config.model_type", v)), base="cfg"))
    for i in range(25):  # unknown keys where the schema has no room for them
        where = rng.choice(["", "train.", "train.optimizer.", "eval.", "pilot.", "pilot.overfit.", "distributed."])
        out.append(Case(f"unknown key {i}", INVALID, _dump(_set(TOY, f"{where}zz_{rng.randrange(10**6)}", 1))))
    for i in range(10):  # keys a factory receives: accepted
        out.append(Case(f"factory key {i}", MAYBE, _dump(_set(TOY, f"model.extra_{i}", rng.random()))))
    good = _dump(TOY)
    for i in range(40):  # truncated and corrupted text
        cut = rng.randrange(1, len(good))
        text = good[:cut] if i % 2 else good[:cut] + rng.choice(["\t", "[", "{", ":", "&", "*", "!!", "- ", "'"])
        out.append(Case(f"truncated {i}", MAYBE, text))
    for depth in (65, 1_000, 20_000):  # nesting
        out.append(Case(f"nested {depth}", INVALID, good + "x: " + "[" * depth + "]" * depth + "\n"))
        out.append(Case(f"nested mapping {depth}", INVALID, good + "x: " + "{a: " * depth + "1" + "}" * depth + "\n"))
    laughs = "".join(f"  l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 10))
    out.append(Case("billion laughs in model extras", INVALID,
                    good.replace("  classes: 3\n", "  classes: 3\n  l0: &l0 [lol, lol, lol, lol, lol, lol, lol]\n"
                                 + laughs)))
    out.append(Case("self-referencing alias", INVALID, good + "x: &x [*x]\n"))
    out.append(Case("30 MB of unknown keys", INVALID, good + "".join(f"k{i}: 1\n" for i in range(2_000_000))))
    for name, text in [("empty", ""), ("a list", "- 1\n- 2\n"), ("a scalar", "42\n"), ("binary", b"\x00\xff\xfe" * 50),
                       ("latin-1", good.replace("toy", "t\xf6y").encode("latin-1")), ("tab indent", "\tname: x\n"),
                       ("duplicate keys", good + "name: other name\n"), ("null name", good.replace("name: toy", "name:"))]:
        out.append(Case(f"file {name}", INVALID, text))
    for v in BAD_SET_VALUES:  # --set values
        out.append(Case(f"--set name={v[:30]!r}", INVALID, good, argv=["--set", f"name={v}"]))
        out.append(Case(f"--set model.dim={v[:30]!r}", MAYBE, good, argv=["--set", f"model.dim={v}"]))
    for kv in ["noequals", "=3", "train.micro_batch_size=0", "seed=-5", "seed=4294967296", "train=3",
               "data.num_workers=1000000", "train.grad_accum_steps=2147483648"]:
        out.append(Case(f"--set {kv}", INVALID, good, argv=["--set", kv]))
    for spec_path in ("/dev/null", "/dev/zero", "/proc/self/status", "/", "/no/such/spec.yaml"):
        out.append(Case(f"spec {spec_path}", INVALID, spec_path=spec_path))
    for label, data_path in [("device", "/dev/zero"), ("folder", "."), ("proc", "/proc/self/status"),
                             ("missing", "nope.jsonl")]:
        out.append(Case(f"data.path {label}", INVALID if label != "proc" else MAYBE,
                        _dump(_set(CONFIG, "data.path", data_path)), base="cfg", argv=["--gates", "lock"]))
    for label, out_arg in [("a file", "toy/toy.py"), ("under a file", "toy/toy.py/out"), ("in /proc", "/proc/self/pilot"),
                           ("/proc itself", "/proc"), ("NUL byte", "a\x00b")]:
        out.append(Case(f"--out {label}", INVALID, good, argv=["--out", out_arg]))
    return out


class Hang(BaseException):
    """Raised by the interval timer: the case did not answer within CASE_SECONDS."""


@contextlib.contextmanager
def time_limit(seconds: float, fired: list):
    """Interrupt the case after ``seconds``; ``fired`` records it (pilotrun's own handler may catch the Hang and
    turn it into an exit code, which must still count as a hang)."""
    def on_alarm(signum, frame):
        fired.append(True)
        raise Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PILOTRUN_CONTAINER_DIGEST", TEST_DIGEST)
    monkeypatch.setenv("COLUMNS", "200")
    toy = copy_fixture("toy", tmp_path).parent
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "data.jsonl").write_text((EXAMPLES / "tiny-sft" / "data.jsonl").read_text())
    os.symlink(EXAMPLES / "tiny-sft" / "tokenizer", cfg / "tokenizer")
    return {"toy": toy, "cfg": cfg}


def test_fuzzed_specs_exit_2_without_traceback_or_hang(folders, tmp_path, capsys):
    all_cases = cases()
    assert len(all_cases) >= 300
    failures, slowest = [], (0.0, "")
    for i, case in enumerate(all_cases):
        folder = folders[case.base]
        if case.spec_path is not None:
            spec = case.spec_path
        else:
            path = folder / f"fuzz-{i}.yaml"
            (path.write_bytes if isinstance(case.text, bytes) else path.write_text)(case.text)  # type: ignore[operator]
            spec = str(path)
        argv = ["run", spec, "--gates", "lock", "--ledger", str(tmp_path / "l.sqlite")]
        if "--out" not in case.argv:
            argv += ["--out", str(tmp_path / "out")]
        t0 = time.monotonic()
        code: int | str
        fired: list = []
        try:
            with time_limit(CASE_SECONDS, fired):
                code = main(argv + case.argv)
        except Hang:
            code = "hang"
        except SystemExit as exc:  # argparse usage errors exit through SystemExit
            code = exc.code if isinstance(exc.code, int) else 2
        if fired:
            code = "hang"
        seconds = time.monotonic() - t0
        slowest = max(slowest, (seconds, case.name))
        text = "".join(capsys.readouterr())
        allowed = {2} if case.expect == INVALID else {0, 2}
        if code not in allowed or "Traceback" in text:
            failures.append(f"{case.name}: exit {code}: {text.strip()[-300:]}")
        elif code == 2 and not text.strip():
            failures.append(f"{case.name}: exit 2 with no message")
    print(f"{len(all_cases)} cases; slowest {slowest[0]:.2f} s ({slowest[1]})")
    assert not failures, "\n".join(failures[:30])


BOOM = "class Boom(BaseException):\n    pass\n\n\nraise Boom('raised on import')\n"
EXIT_ON_CALL = "import os\n\nfrom toy import build_data  # noqa: F401\n\n\ndef build_model(cfg):\n    os._exit(0)\n"
EXIT_ON_IMPORT = "import os\n\nos._exit(0)\n"


@pytest.mark.process
def test_real_processes_exit_2_or_fail_the_gate(folders, tmp_path):
    """What cannot run inside pytest's own process: a FIFO that blocks when opened, a bad $RANK, user code that
    ends the process. Started together, waited on with a timeout (a hang fails the test, it does not block it)."""
    toy = folders["toy"]
    os.mkfifo(tmp_path / "spec.fifo")
    (toy / "boom.py").write_text(BOOM)
    (toy / "exit_on_call.py").write_text(EXIT_ON_CALL)
    (toy / "exit_on_import.py").write_text(EXIT_ON_IMPORT)
    text = (toy / "pilot.yaml").read_text()
    for mod in ("boom", "exit_on_call", "exit_on_import"):
        (toy / f"{mod}.yaml").write_text(text.replace("toy:build_model", f"{mod}:build_model"))
    runs = {  # name: (argv, extra env, expected exit, words the output must contain)
        "spec is a FIFO": (["run", str(tmp_path / "spec.fifo")], {}, 2, "FIFO"),
        "RANK=abc": (["run", "pilot.yaml", "--gates", "lock"], {"RANK": "abc"}, 2, "$RANK='abc'"),
        "BaseException on import": (["run", "boom.yaml", "--gates", "lock"], {}, 2, "raised Boom"),
        "os._exit on import": (["run", "exit_on_import.yaml", "--gates", "lock"], {}, 2, "os._exit(0)"),
        # A factory that ends the process is a failed load gate, never exit 0.
        "os._exit in the factory": (["run", "exit_on_call.yaml", "--gates", "load"], {}, 1, "os._exit(0)"),
    }
    procs = {}
    for name, (argv, env, _, _) in runs.items():
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pilotrun", *argv, "--ledger", str(tmp_path / f"{len(procs)}.sqlite"),
             "--out", str(tmp_path / f"out{len(procs)}")], cwd=toy, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "COLUMNS": "200", **env})
    failures = []
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            failures.append(f"{name}: hung")
            continue
        _, _, expected, words = runs[name]
        if proc.returncode != expected or words not in output or "Traceback" in output:
            failures.append(f"{name}: exit {proc.returncode} (expected {expected}): {output.strip()[-400:]}")
    assert not failures, "\n".join(failures)
