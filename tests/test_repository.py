"""The repository stands alone: no tracked file points at a file users do not have (a design
note or a folder beside the checkout) or at a development machine's absolute paths. Commands in
the docs run from the repository root; a comment says in place what it means, never its history
(issue numbers, when a run was made, a development branch or session): that goes to
docs/benchmarks-history.md or the commit message."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What no tracked file may name (the patterns are written so that this file does not match them).
OUTSIDE = {
    "a design note outside the repository": re.compile(r"\bDESIGN\.md", re.IGNORECASE),
    "a folder beside the checkout": re.compile(r"\.\./shared\b"),
    "a development machine's absolute path": re.compile(r"(?<![\w.~-])/(?:work|root|home)/"),
}
# What the code, its comments and docstrings, and the configs may not carry (the docs' prose and
# the recorded results date their measurements by design). Written so that this file does not
# match them.
HISTORY = {
    "an issue number": re.compile(r"\bissue ?#?\d+", re.IGNORECASE),
    "the clock time of a run": re.compile(r"\b\d{1,2}:\d{2} UTC\b"),
    "a development branch or session": re.compile(r"\bthis (?:branch|session)\b", re.IGNORECASE),
    "a day relative to the writing": re.compile(r"\b(?:to|yester)(?:day)\b", re.IGNORECASE),
}
DATED = (".md", ".json", ".jsonl")  # prose and recorded results: HISTORY does not apply


def tracked_files():
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout ({err}): nothing lists the tracked files")
    return [ROOT / name for name in done.stdout.decode().split("\0") if name]


def references_outside(paths, root=ROOT, patterns=OUTSIDE):
    """'file:line: what (the text)' for each line of `paths` (named relative to `root`) that names
    something of `patterns` (OUTSIDE)."""
    hits = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # a binary file, or one deleted in the work tree
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in patterns.items():
                if pattern.search(line):
                    hits.append(f"{path.relative_to(root)}:{number}: {what} ({line.strip()[:120]})")
    return hits


def test_no_tracked_file_refers_outside_the_repository():
    hits = references_outside(tracked_files())
    assert not hits, "tracked files that refer outside the repository:\n" + "\n".join(hits)


def test_no_code_comment_or_config_carries_history():
    code = [path for path in tracked_files() if not path.name.endswith(DATED)]
    hits = references_outside(code, patterns=HISTORY)
    assert not hits, "history in code, comments or configs (it belongs in docs/benchmarks-history.md " \
                     "or the commit message):\n" + "\n".join(hits)


def test_the_history_scan_sees_each_kind(tmp_path):
    # each one split in two literals, so that this file does not carry them itself
    lines = ["# see issue" " 48 for the numbers", "# run 1 (09:42" " UTC) on the loaded machine",
             "# this" " branch adds the pairing", "# the model has no random op to" "day",
             "# the issue order of the buckets; a session of the process group", "# measured at 1 430 MB/s"]
    (tmp_path / "notes.py").write_text("\n".join(lines) + "\n")
    hits = references_outside([tmp_path / "notes.py"], tmp_path, HISTORY)
    assert [h.split(": ")[0] for h in hits] == [f"notes.py:{n}" for n in (1, 2, 3, 4)], hits


def test_the_scan_sees_each_kind_of_reference(tmp_path):
    # each reference split in two literals, so that this file does not name them itself
    lines = ["see DESIGN" ".md section 4", "the steps are in ../" "shared/GPU.md", "cd /" "work/main && make bench",
             "run.dir=/shared/runs/my-run checkpoint.dir=/tmp/x", "python -m bench.run --out runs/bench"]
    (tmp_path / "notes.md").write_text("\n".join(lines) + "\n")
    hits = references_outside([tmp_path / "notes.md"], tmp_path)
    assert [h.split(": ")[0] for h in hits] == [f"notes.md:{n}" for n in (1, 2, 3)], hits
