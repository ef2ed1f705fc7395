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
from tests.conftest import EXAMPLES, TEST_DIGEST, copy_fixture

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

PROGRAM = {"name": "prog", "program": {"command": "python train.py"}, "pilot": {"resume": {"before": 2, "after": 2}}}
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
    words: str = ""                          # what the output must contain


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
    out += optimizer_cases() + model_cases() + program_cases() + factory_cases()
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


def optimizer_cases() -> list[Case]:
    """train.optimizer's real-valued keys outside what torch accepts (config/limits.py FLOAT_BOUNDS), and values
    just inside, which the spec accepts."""
    out = []
    bad = [("lr", 1e30), ("lr", 1e3), ("eps", -1.0), ("betas", [1.5, 0.999]), ("betas", [0.9, 1.0]),
           ("betas", [-0.1, 0.9]), ("momentum", -1.0), ("momentum", 1.0), ("weight_decay", -1.0)]
    for name in ("adamw", "sgd"):
        for key, value in bad:
            spec = _set(_set(TOY, "train.optimizer.name", name), f"train.optimizer.{key}", value)
            out.append(Case(f"{name} {key}={value}", INVALID, _dump(spec), words=f"train.optimizer.{key}"))
    for key, value in [("lr", 100.0), ("lr", 1.0), ("betas", [0.0, 0.0]), ("momentum", 0.99), ("eps", 0.0)]:
        out.append(Case(f"inside {key}={value}", MAYBE, _dump(_set(TOY, f"train.optimizer.{key}", value))))
    return out


def model_cases() -> list[Case]:
    """Adapter and quantisation keys, and model.config's sizes, on the config model (all checked before a gate)."""
    out = []
    for key, value in [("r", 10**30), ("r", 2**31), ("r", 0), ("r", -1), ("alpha", 0), ("alpha", -1.0),
                       ("dropout", 1.0), ("dropout", -0.5), ("target_modules", ""), ("target_modules", []),
                       ("target_modules", "q_proj"), ("type", "qlora"), ("target_modules", ["no_such_layer"])]:
        spec = _set(CONFIG, "model.adapter", {key: value})
        out.append(Case(f"adapter {key}={value!r}", INVALID, _dump(spec), base="cfg", words=f"model.adapter.{key}"))
    for key, value in [("bits", 3), ("bits", 16), ("type", "int4"), ("compute_dtype", "fp8"), ("double_quant", "x")]:
        spec = _set(_set(CONFIG, "model.adapter", {"r": 4}), "model.quantization", {"bits": 4, key: value})
        out.append(Case(f"quantization {key}={value!r}", INVALID, _dump(spec), base="cfg",
                        words=f"model.quantization.{key}"))
    out.append(Case("quantization without adapter", INVALID, _dump(_set(CONFIG, "model.quantization", {"bits": 4})),
                    base="cfg"))
    out.append(Case("quantization of a factory", INVALID, _dump(_set(_set(TOY, "model.quantization", {"bits": 8}),
                                                                   "model.adapter", {"r": 4})), base="toy"))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings"):
        for value in (0, -1, 2**31):
            out.append(Case(f"config {key}={value}", INVALID, _dump(_set(CONFIG, f"model.config.{key}", value)),
                            base="cfg", words=f"model.config.{key}"))
    out.append(Case("config kv heads not dividing", INVALID, _dump(_set(CONFIG, "model.config.num_key_value_heads",
                                                                         3)), base="cfg"))
    out.append(Case("config more heads than hidden", INVALID, _dump(_set(_set(
        CONFIG, "model.config.num_attention_heads", 32), "model.config.num_key_value_heads", 32)), base="cfg"))
    return out


def program_cases() -> list[Case]:
    """Program specs (their own shape: name and program:), refused before the program is started."""
    out = [Case("program null", INVALID, _dump({"name": "prog", "program": None}), base="prog", words="program"),
           Case("program null with model", MAYBE, _dump({**TOY, "program": None}), base="toy")]
    for key, value in [("files", []), ("files", ["/etc/passwd"]), ("files", ["../toy/toy.py"]),
                       ("files", ["outside-link.py"]), ("files", ["nothing-*.py"]), ("command", "python -m nosuchmod"),
                       ("command", "python -u -m nosuch.sub"), ("command", "python -m json.nosuch"),
                       ("command", ""), ("command", []), ("timeout", -1), ("compare", "close")]:
        out.append(Case(f"program {key}={value!r}", INVALID, _dump(_set(PROGRAM, f"program.{key}", value)),
                        base="prog", words=f"program.{key}"))
    for key, value in [("pilot.resume.before", 10**9), ("pilot.resume.after", 10**9), ("pilot.resume.before", 0),
                       ("pilot.updates", 10**9), ("seed", -1), ("pilot.factory_timeout", 0)]:
        out.append(Case(f"program {key}={value}", INVALID, _dump(_set(PROGRAM, key, value)), base="prog",
                        words=key))
    for command in ("python -m json.tool --help", "python train.py --updates 4"):  # found without importing
        out.append(Case(f"program {command!r}", MAYBE, _dump(_set(PROGRAM, "program.command", command)), base="prog"))
    return out


def factory_cases() -> list[Case]:
    """User factories that raise, loop or interrupt while the spec is checked: exit 2 naming the field, in bounded
    time (pilot.factory_timeout, here 2 s)."""
    out = []
    for module, words in [("loop_import", "factory_timeout"), ("interrupt_import", "KeyboardInterrupt"),
                          ("raising", "model.factory")]:
        spec = _set(TOY, "model.factory", f"{module}:build_model")
        if module == "loop_import":
            spec = _set(spec, "pilot.factory_timeout", 2)
        if module == "raising":  # check_job builds it on the meta device to read its Linear layers
            spec = _set(spec, "model.adapter", {"target_modules": ["hidden"]})
        out.append(Case(f"factory {module}", INVALID, _dump(spec), words=words))
    for value in (0, -5, "soon"):
        out.append(Case(f"factory_timeout {value!r}", INVALID, _dump(_set(TOY, "pilot.factory_timeout", value))))
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
    prog = tmp_path / "prog"
    prog.mkdir()
    (prog / "train.py").write_text("import pilotrun\n\njob = pilotrun.program()\n")
    (tmp_path / "elsewhere.py").write_text("secret = 1\n")
    os.symlink(tmp_path / "elsewhere.py", prog / "outside-link.py")
    for name, text in USER_MODULES.items():
        (toy / f"{name}.py").write_text(text)
    return {"toy": toy, "cfg": cfg, "prog": prog}


USER_MODULES = {
    "loop_import": "while True:\n    pass\n",
    "interrupt_import": "raise KeyboardInterrupt\n",
    "raising": "from toy import build_data  # noqa: F401\n\n\ndef build_model(cfg):\n    raise ValueError('bad dim')\n",
    "interrupt_call": "from toy import build_data  # noqa: F401\n\n\ndef build_model(cfg):\n    raise KeyboardInterrupt\n",
    "signal_call": ("import os\nimport signal\nimport time\n\nfrom toy import build_data  # noqa: F401\n\n\n"
                    "def build_model(cfg):\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n"),
}


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
        elif case.words and case.words not in text:
            failures.append(f"{case.name}: exit {code} without {case.words!r}: {text.strip()[-300:]}")
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
    # A module that loops when imported, in a real `pilotrun run` (its SIGALRM, its own main thread).
    (toy / "loop.yaml").write_text(_dump(_set(_set(TOY, "model.factory", "loop_import:build_model"),
                                              "pilot.factory_timeout", 2)))
    runs = {  # name: (argv, extra env, expected exit, words the output must contain)
        "spec is a FIFO": (["run", str(tmp_path / "spec.fifo")], {}, 2, "FIFO"),
        "RANK=abc": (["run", "pilot.yaml", "--gates", "lock"], {"RANK": "abc"}, 2, "$RANK='abc'"),
        "BaseException on import": (["run", "boom.yaml", "--gates", "lock"], {}, 2, "raised Boom"),
        "os._exit on import": (["run", "exit_on_import.yaml", "--gates", "lock"], {}, 2, "os._exit(0)"),
        "loops on import": (["run", "loop.yaml", "--gates", "lock"], {}, 2, "pilot.factory_timeout"),
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


def _run_main(argv: list[str], capsys) -> tuple[int | str, str]:
    fired: list = []
    try:
        with time_limit(CASE_SECONDS, fired):
            code: int | str = main(argv)
    except Hang:
        code = "hang"
    return ("hang" if fired else code), "".join(capsys.readouterr())


def test_factory_calls_are_bounded_and_their_keyboard_interrupt_is_a_failure(folders, tmp_path, capsys):
    """The load gate calls the factories: one asked for 2**31 examples ends at pilot.factory_timeout as a failed
    row, and a KeyboardInterrupt the factory raises itself is a failed row, not "interrupted (Ctrl-C)"; a real
    SIGINT during the call still stops the pilot (exit 130)."""
    toy = folders["toy"]
    runs = {  # name: (spec, expected exit, words)
        "2**31 examples": (_set(_set(TOY, "data.examples", 2**31), "pilot.factory_timeout", 2), 1, "factory_timeout"),
        "KeyboardInterrupt raised": (_set(TOY, "model.factory", "interrupt_call:build_model"), 1, "no stop signal"),
        "SIGINT sent": (_set(TOY, "model.factory", "signal_call:build_model"), 130, "interrupted"),
    }
    failures = []
    for i, (name, (spec, expected, words)) in enumerate(runs.items()):
        path = toy / f"call-{i}.yaml"
        path.write_text(_dump(spec))
        t0 = time.monotonic()
        code, text = _run_main(["run", str(path), "--gates", "load", "--ledger", str(tmp_path / "l.sqlite"),
                                "--out", str(tmp_path / f"out{i}")], capsys)
        if code != expected or words not in text or "Traceback" in text or time.monotonic() - t0 > 15:
            failures.append(f"{name}: exit {code} (expected {expected}, {words!r}): {' '.join(text.split())[-300:]}")
    assert not failures, "\n".join(failures)


def test_factory_guard_leaves_an_outer_timer_running():
    """The guard borrows SIGALRM: an outer interval timer (this module's own time_limit) keeps its handler and the
    time it had left; one that ends before the guard's limit is not replaced at all."""
    from pilotrun.config.factories import FactoryTimeout, factory_guard

    fired: list = []
    with time_limit(30, fired):
        handler = signal.getsignal(signal.SIGALRM)
        with factory_guard("a quick call", 5):
            assert signal.getsignal(signal.SIGALRM) is not handler
        assert signal.getsignal(signal.SIGALRM) is handler and 25 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30
        with pytest.raises(FactoryTimeout, match=r"within 0.2 s \(pilot.factory_timeout"):
            with factory_guard("a loop", 0.2):
                while True:
                    try:
                        time.sleep(0.01)
                    except Exception:  # user code that swallows what it can: the alarm is a BaseException
                        pass
        with factory_guard("under a sooner outer timer", 60):
            assert signal.getsignal(signal.SIGALRM) is handler
    assert not fired


CAMPAIGN = {"base": "toy/pilot.yaml", "vary": {"train.optimizer.lr": [0.01, 0.02]}, "seeds": [1, 2], "updates": 8}


def campaign_cases() -> list[tuple[str, dict, str]]:
    """(name, campaign mapping, the field its error must name): the campaign's own numbers are the campaign's
    fault, never the varied key's; a varied value the run spec refuses is the varied key's."""
    out = []
    for value in ([-1], [2**32], [1, 2**40], [], [1, 1], ["a"], [True], -1):
        out.append((f"seeds {value!r}", _set(CAMPAIGN, "seeds", value), "seeds"))
    for key, values in [("updates", (0, -1, 2**60, 1.5)), ("eval.every", (0, 2**60, "x")),
                        ("keep.control_set", (-1, 10**9, "all")), ("stop.divergence", (1.0, -3)),
                        ("stop.budget_minutes", (0, -1)), ("processes", (0, -2))]:
        for value in values:
            out.append((f"{key} {value!r}", _set(CAMPAIGN, key, value), key))
    for values in ([0.01, 1e30], [0.01, -1.0], [0.01, "fast"]):
        out.append((f"vary lr {values!r}", _set(CAMPAIGN, "vary", {"train.optimizer.lr": values}),
                    "train.optimizer.lr"))
    out.append(("vary betas", _set(CAMPAIGN, "vary", {"train.optimizer.betas": [[0.9, 0.99], [0.9, 1.5]]}),
                "train.optimizer.betas"))
    out.append(("vary a fixed key", _set(CAMPAIGN, "vary", {"seed": [1, 2]}), "vary.seed"))
    out.append(("vary two keys", _set(CAMPAIGN, "vary", {"train.optimizer.lr": [1, 2], "train.max_grad_norm": [1, 2]}),
                "vary"))
    return out


def test_fuzzed_campaign_specs_name_their_own_field(folders, tmp_path):
    """campaign.yaml mutations, validated in this process as `pilotrun campaign` does before any run starts
    (load_campaign, then every run's spec): each is a SpecError or CampaignError naming its own field."""
    from pilotrun.campaign.orchestrate import CampaignError, prepare
    from pilotrun.campaign.spec import load_campaign
    from pilotrun.config.schema import SpecError

    failures = []
    for i, (name, mapping, field_name) in enumerate(campaign_cases()):
        path = tmp_path / f"campaign-{i}.yaml"
        path.write_text(_dump(mapping))
        try:
            prepare(load_campaign(path))
        except SpecError as exc:
            fields = [f for f, _ in exc.problems]
            if not any(f == field_name or f.startswith((field_name + ".", field_name + "[")) for f in fields):
                failures.append(f"{name}: blamed {fields}: {exc}")
        except CampaignError as exc:
            if not str(exc).startswith((field_name, f"vary: {field_name}")) or field_name not in str(exc):
                failures.append(f"{name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any other exception is an exit 3
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            failures.append(f"{name}: accepted")
    assert not failures, "\n".join(failures)
