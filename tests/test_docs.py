"""The documentation stays true: README.md and docs/*.md against the code they describe.

- docs/rules.md is the rule registry's own text (`mpoverlap-check --rules --markdown`);
- every config key (the schema in mpoverlap/schema.py and every YAML file in conf/) and every
  preset name appears in backticks on some page;
- every concrete `mpoverlap-check` command in a code block (no <placeholder>) runs in-process
  and exits as documented: 0, or 2 where its line says `# exit 2` (a slow one may say
  `# ... not run by the docs test`); every concrete `mpoverlap-train` command's configuration
  composes and validates;
- code quoted from a file (a fence whose info string is `python <path>`) is in that file verbatim;
- every relative link (file, and #anchor on a page) resolves.

Every page counts, including docs pages added later: the pages are found by globbing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHECK = re.compile(r"^(?:\.venv/bin/)?mpoverlap-check(?:\s|$)")
TRAIN = re.compile(r"^(?:\.venv/bin/)?mpoverlap-train\s")
# A command too slow for the test (a full --search) says so in its comment, visibly.
NOT_RUN = "not run by the docs test"


def pages():
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@lru_cache(maxsize=None)
def tokens(page: Path):
    return MarkdownIt("commonmark").enable("table").parse(page.read_text())


def inline_children(page: Path):
    for tok in tokens(page):
        if tok.type == "inline":
            yield from tok.children or []


def code_texts(page: Path):
    """Inline code spans and fenced/indented code blocks of a page."""
    for tok in tokens(page):
        if tok.type in ("fence", "code_block"):
            yield tok.content
    for child in inline_children(page):
        if child.type == "code_inline":
            yield child.content


def slug(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset:
    seen: dict = {}
    out = set()
    toks = tokens(page)
    for i, tok in enumerate(toks):
        if tok.type == "heading_open":
            text = "".join(c.content for c in toks[i + 1].children if c.type in ("text", "code_inline"))
            base = slug(text)
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


# ---- the rule reference ---------------------------------------------------------------------------

def test_rules_page_is_the_registry():
    from mpoverlap.check import rules_markdown

    page = DOCS / "rules.md"
    assert page.read_text() == rules_markdown() + "\n", (
        "docs/rules.md differs from the rule registry: regenerate it with "
        "`.venv/bin/mpoverlap-check --rules --markdown > docs/rules.md`")


# ---- config keys ------------------------------------------------------------------------------------

def schema_keys():
    from mpoverlap.config import MPOverlapConfig

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                yield from walk(type(default), f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    return set(walk(MPOverlapConfig, ""))


def conf_keys():
    """(keys, preset names) of conf/: `<group>.<key>` for every key of every group's YAML file."""
    keys, presets = set(), set()

    def flatten(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                flatten(v, f"{prefix}{k}.")
            else:
                keys.add(f"{prefix}{k}")

    conf = ROOT / "conf"
    for path in sorted(conf.glob("*/*.yaml")):
        group = path.parent.name
        presets.add(f"{group}={path.stem}")
        flatten(yaml.safe_load(path.read_text()) or {}, f"{group}.")
    for path in sorted(conf.glob("*.yaml")):
        root = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items() if k != "defaults"}
        flatten(root, "")
    return keys, presets


def test_conf_keys_come_from_the_schema():
    """The coverage test below reads both; a key only in conf/ would be an untyped one."""
    keys, _ = conf_keys()
    assert keys <= schema_keys(), sorted(keys - schema_keys())


def test_every_config_key_and_preset_is_documented():
    code = "\n".join(t for p in pages() for t in code_texts(p))
    keys, presets = conf_keys()
    missing = sorted(k for k in keys | schema_keys() if not re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", code))
    assert not missing, f"config keys in no backticks of README.md or docs/*.md: {missing}"
    # A preset counts when its name appears in code next to its group (`model=llama3_8b`,
    # `model=gpt_tiny|llama3_8b`, `hardware=<preset>` lists) or alone in backticks.
    missing_presets = sorted(p for p in presets if not re.search(rf"(?<![\w.]){re.escape(p.split('=')[1])}(?!\w)", code))
    assert not missing_presets, f"presets named in no backticks: {missing_presets}"


# ---- commands -------------------------------------------------------------------------------------

def documented_commands(command: re.Pattern):
    """(page, command line, expected exit code) of every line in a code block that `command`
    matches."""
    out = []
    for page in pages():
        for tok in tokens(page):
            if tok.type not in ("fence", "code_block"):
                continue
            for line in tok.content.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                code, _, comment = line.partition(" #")
                if command.match(line) and NOT_RUN not in comment:
                    expected = 2 if re.search(r"\bexit 2\b", comment) else 0
                    out.append((page.relative_to(ROOT).as_posix(), code.strip(), expected))
    return out


def concrete(code: str) -> bool:
    """A command a user can paste as it is: no <placeholder>, no `...` left to fill in."""
    return "<" not in code and "..." not in code


def documented_checks():
    return [c for c in documented_commands(CHECK) if concrete(c[1])]


def documented_trainings():
    """Concrete `mpoverlap-train` lines (no -m sweep): too expensive to run here, but their
    configuration must compose and validate."""
    return [c for c in documented_commands(TRAIN) if concrete(c[1]) and " -m " not in c[1]]


def test_docs_show_commands():
    assert len(documented_checks()) >= 8, documented_checks()
    assert len(documented_trainings()) >= 5, documented_trainings()


@pytest.mark.parametrize("page,command,expected", documented_checks(),
                         ids=[f"{p}: {c}" for p, c, _ in documented_checks()])
def test_documented_check_command_exits_as_documented(page, command, expected):
    from mpoverlap.check import main

    args = shlex.split(command)[1:]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    assert rc == expected, f"{page}: `{command}` exited {rc}, documented {expected}\n{out.getvalue()[-2000:]}" \
                           f"\n{err.getvalue()[-2000:]}"


@pytest.mark.parametrize("page,command,expected", documented_trainings(),
                         ids=[f"{p}: {c}" for p, c, _ in documented_trainings()])
def test_documented_training_command_validates(page, command, expected):
    from mpoverlap.config import compose
    from mpoverlap.overlap.rules import validate

    problems = [p.render() for p in validate(compose(shlex.split(command)[1:]))]
    assert bool(problems) == (expected == 2), f"{page}: `{command}`: {problems}"


# ---- links ----------------------------------------------------------------------------------------

def relative_links():
    out = []
    for page in pages():
        for child in inline_children(page):
            target = child.attrs.get("href") if child.type == "link_open" else \
                child.attrs.get("src") if child.type == "image" else None
            if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                out.append((page, target))
    return out


def test_relative_links_resolve():
    broken = []
    for page, target in relative_links():
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "\n".join(broken)
    assert len(relative_links()) >= 20


def test_link_checker_finds_a_broken_anchor(tmp_path):
    """The slugs follow GitHub's rule, so a link the test accepts is one GitHub resolves."""
    page = tmp_path / "p.md"
    page.write_text("# The validator's messages\n\n## `overlap.dp` and ZeRO-3 / FSDP\n\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"the-validators-messages", "overlapdp-and-zero-3--fsdp", "notes", "notes-1"}


# ---- quoted code ----------------------------------------------------------------------------------

def quoted_snippets():
    out = []
    for page in pages():
        for tok in tokens(page):
            parts = tok.info.split() if tok.type == "fence" else []
            if len(parts) == 2 and "/" in parts[1]:
                out.append((page.relative_to(ROOT).as_posix(), parts[1], tok.content.rstrip("\n")))
    return out


def test_quoted_code_is_in_its_file():
    snippets = quoted_snippets()
    assert len(snippets) >= 4
    # whole lines: the quote starts and ends at line boundaries of the file
    stale = [f"{page}: the code quoted from {path} is no longer in it" for page, path, code in snippets
             if f"\n{code}\n" not in f"\n{(ROOT / path).read_text()}\n"]
    assert not stale, "\n".join(stale)
