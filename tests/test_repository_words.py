"""The repository speaks of the software, not of how it was built: no tracked file (name or text)
holds words of the work's own history, such as numbered work periods, runs on a lent machine, or
scripts kept for one measurement. Every offending file:line is printed."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each pattern is written so that its own source text does not match it (a word split by a
# group), so this file checks itself like any other.
WORDS = [re.compile(p, re.I) for p in (
    r"\bsess(?:ion)[\s_-]*\d",        # a numbered work period, also in file names
    r"\bsess(?:ion)s\b",
    r"\bthis (?:sess)ion\b",
    r"\bdevice (?:call)s?\b",
    r"\bmachine (?:start)s?\b",
    r"\bprobe, (?:not) kept\b",
    r"\bthrow(?:away)\b",
    r"\bthe (?:issue)\b",
    r"\bGPU (?:issue)\b",
    r"\bissue[\s_#-]*(?:\d)",
)]



def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p]


def _text(path: str) -> str | None:
    """The file's text, or None for a binary file (or one deleted from the work tree)."""
    try:
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _offences(path: str) -> list[str]:
    found = [f"{path}: file name" for w in WORDS if w.search(path)][:1]
    text = _text(path)
    if text is None:
        return found
    for number, line in enumerate(text.splitlines(), 1):
        if any(w.search(line) for w in WORDS):
            found.append(f"{path}:{number}: {line.strip()[:160]}")
    return found


def test_patterns_catch_what_they_should():
    caught = ["after sess" "ion 36", "collectives-sess" "ion36-1.json", "in one devi" "ce call",
              "one machi" "ne start", "a throw" "away script", "see the iss" "ue", "iss" "ue 4's bound",
              "a probe, n" "ot kept"]
    fine = ["start_new_session=True", "setsid: a new process session", "the process group",
            "shared by the whole session", "pytest_sessionfinish(session, exitstatus)",
            "an issue with the driver", "NVSHMEM device functions for kernels"]
    assert [s for s in caught if not any(w.search(s) for w in WORDS)] == []
    assert [s for s in fine if any(w.search(s) for w in WORDS)] == []


def test_tracked_files_speak_of_the_software():
    offences = [o for path in _tracked_files() for o in _offences(path)]
    print("\n".join(offences))
    assert not offences, f"{len(offences)} line(s) speak of how the work was done:\n" + "\n".join(offences)
