"""The documentation: a README a newcomer reads in five minutes, the pages under docs/, and the site built from them.

What a reader copies must work: every `pilotrun …` line in a code block of the README, CONTRIBUTING.md or docs/ is
parsed by the command's own parser (a removed flag or a misspelt subcommand fails here), every example spec the
pages name loads, every relative link resolves, the CLI page equals what its generator writes from the parser, and
the site builds with `mkdocs build --strict` (broken links and anchors, pages missing from the nav) and opens in
a real browser."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import open_in_chromium

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def code_commands(text: str) -> list[str]:
    """The `pilotrun …` command lines of the fenced code blocks in ``text`` (continuations joined, a leading
    `VAR=value` dropped), as they would be typed."""
    commands = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        for line in joined.splitlines():
            words = line.strip().split(" ")
            while words and ENV_WORD.match(words[0]):
                words = words[1:]
            if words and words[0] == "pilotrun":
                commands.append(" ".join(words))
    return commands


SHELL_ENDS = {">", ">>", "<", "|", "||", "&&", ";", "&"}


def argv_of(command: str) -> list[str]:
    """The words the shell would hand pilotrun: a `$VAR` filled with a well-formed value, the line cut at the first
    redirection or pipe (`--json > report.json`), comments dropped."""
    words = shlex.shlex(re.sub(r"\$\{?[A-Z_][A-Z0-9_]*\}?", "x1", command), posix=True, punctuation_chars=True)
    words.whitespace_split = True
    argv = []
    for word in words:
        if word in SHELL_ENDS:
            break
        argv.append(word)
    return argv[1:]


def parse_error(command: str) -> str | None:
    """None when the CLI's own parser accepts ``command``; else what it said."""
    from pilotrun.cli import build_parser, command_in

    argv = argv_of(command)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            build_parser(command_in(argv)).parse_args(argv)
    except SystemExit as exc:
        return f"exit {exc.code}: {stderr.getvalue().strip()}"
    return None


def every_command() -> list[tuple[str, str]]:
    return [(str(page.relative_to(ROOT)), c) for page in PAGES for c in code_commands(page.read_text())]


def test_code_commands_finds_commands_and_skips_the_rest():
    text = ("```bash\nCUDA_VISIBLE_DEVICES=4,5 pilotrun campaign a.yaml --parallel 8   # note\n"
            "pilotrun plan p.yaml \\\n  --runs 6\nsky jobs launch task.yaml\n```\n"
            "pilotrun run outside.yaml\n```python\nimport pilotrun\n```\n")
    assert code_commands(text) == ["pilotrun campaign a.yaml --parallel 8   # note", "pilotrun plan p.yaml --runs 6"]
    assert parse_error("pilotrun run pilot.yaml --gates eval") is None
    assert "--no-such-flag" in (parse_error("pilotrun run pilot.yaml --no-such-flag") or "")
    assert "invalid choice" in (parse_error("pilotrun runn pilot.yaml") or "")
    assert argv_of('pilotrun campaign c.yaml --task-id "$SKYPILOT_TASK_ID" > out.txt  # c') == \
        ["campaign", "c.yaml", "--task-id", "x1"]
    assert argv_of("pilotrun ledger --csv | head") == ["ledger", "--csv"]


def test_every_documented_command_parses():
    commands = every_command()
    assert len(commands) > 60, commands  # the README's and the guides' blocks, not an empty match
    assert {"run", "campaign", "select", "plan", "ledger", "launch", "lock"} <= {c.split()[1] for _, c in commands}
    # A bare `...` elides required words (the `batch` help's own example): nothing to parse there.
    bad = [f"{page}: {c}\n    {err}" for page, c in commands if "..." not in c.split() and (err := parse_error(c))]
    assert not bad, "commands in the docs the CLI refuses:\n" + "\n".join(bad)


def named_example_specs() -> set[Path]:
    """Every spec file under examples/ the pages name: a .yaml path, or a folder holding a pilot.yaml."""
    found: set[Path] = set()
    for page in PAGES:
        for name in re.findall(r"examples/[A-Za-z0-9_./-]+", page.read_text()):
            path = ROOT / name.rstrip("./")
            if path.suffix in (".yaml", ".yml"):
                assert path.is_file(), f"{page.relative_to(ROOT)} names {name}, which does not exist"
                found.add(path)
            elif path.is_dir() and (path / "pilot.yaml").is_file():
                found.add(path / "pilot.yaml")
    return found


def test_every_example_spec_named_in_the_docs_loads():
    from pilotrun.campaign.spec import load_campaign
    from pilotrun.config import load_spec
    from pilotrun.estimate.catalog import load_catalog

    specs = named_example_specs()
    assert ROOT / "examples/own-loop/pilot.yaml" in specs and ROOT / "examples/campaign/lr-sweep.yaml" in specs
    for path in sorted(specs):
        if path.parent.name == "campaign":
            assert load_campaign(path).vary, path
        elif path.parent.name == "catalog":
            assert load_catalog(path), path
        else:
            assert load_spec(path, allow_program=True).name, path


def test_the_readme_specs_load(tmp_path):
    """The README's two specs (a program's, pilotrun's own loop's) are whole specs, not fragments: they load, with
    the files they name standing beside them."""
    from pilotrun.config import load_spec

    blocks = re.findall(r"^```yaml\n(.*?)^```", README.read_text(), re.S | re.M)
    specs = [b for b in blocks if re.search(r"^name: ", b, re.M)]
    assert len(specs) == 2, specs
    (tmp_path / "train.py").write_text("")
    (tmp_path / "my-model").mkdir()
    for i, text in enumerate(specs):
        (tmp_path / f"s{i}.yaml").write_text(text)
        spec = load_spec(tmp_path / f"s{i}.yaml", check_files=False, allow_program=True)
        assert spec.name in ("own-loop", "my-job"), spec.name


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if not target.startswith(("http:", "https:", "#", "mailto:")):
                if not (page.parent / target.split("#")[0]).exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_readme_is_the_five_minute_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    head = "\n".join(lines[:120])
    for way in ("pilotrun.program()", "pilotrun.integrations.transformers import PilotrunCallback",
                "pilotrun.integrations.lightning import PilotrunCallback", "pilotrun.integrations.accelerate import begin",
                "own loop: `pilot.yaml`"):
        assert way in head, f"{way!r} is not in README.md's first 120 lines"
    own_loop = lines.index("name: my-job")  # the pilot.yaml of pilotrun's own loop, the last way in
    assert own_loop < 120 and lines.index("```", own_loop) < 120, "the ways in must fit README.md's first 120 lines"
    text = "\n".join(lines)
    assert "make demo" in "\n".join(lines[:25]) and "make test" in "\n".join(lines[:25])
    for step in ("docs/guides/choose-accelerator.md", "docs/guides/campaigns.md", "docs/guides/renting.md"):
        assert f"({step})" in text, step


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    columns = os.environ.get("COLUMNS")
    try:
        spec.loader.exec_module(module)
        return module.markdown()
    finally:  # the generator fixes the width for its own page; the tests after this one keep theirs
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def test_cli_reference_is_in_step_with_the_parser():
    from pilotrun.cli.common import COMMANDS

    written = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert written == _generator(), "docs/reference/cli.md is stale: python docs/gen_cli.py > docs/reference/cli.md"
    for name in COMMANDS:
        assert f"## `pilotrun {name}`" in written, name
    assert "--resume [RUN]" in written and "### `pilotrun lock export`" in written


def _mkdocs_available() -> bool:
    return importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The documentation site built once with ``mkdocs build --strict`` (broken links and anchors fail it)."""
    assert _mkdocs_available(), "mkdocs and mkdocs-material are in the dev extra: pip install -e '.[dev]'"
    site = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    return site


@pytest.mark.process
def test_the_site_builds_strictly_with_every_page_and_its_search(site):
    for page in ("index.html", "guides/program/index.html", "reference/gates/index.html", "spec/index.html",
                 "reference/cli/index.html", "reference/exit-codes/index.html"):
        assert (site / page).is_file(), page
    search = (site / "search" / "search_index.json").read_text()
    assert "accum_equivalence" in search and "should_save" in search
    gates = (site / "reference" / "gates" / "index.html").read_text()
    assert "On a program" in gates and "reload_eval" in gates


@pytest.mark.process
@pytest.mark.browser
def test_the_site_opens_in_a_real_browser(site, tmp_path):
    dom, console, _ = open_in_chromium(site / "index.html", tmp_path)
    assert "Read the rows" in dom and "md-search" in dom, dom[:2000]
    assert 'href="guides/program/"' in dom
