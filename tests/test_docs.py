"""The user docs hold: every ```python block of README.md and docs/*.md runs as written on 2 CPU
ranks and computes what it says (blocks that cannot run on a CPU are marked ``<!-- not run: why
-->``); every relative link and anchor of the docs resolves; the README and the results folder
stay small."""

import os
import re

import pytest

from tests import jobs_docs as J

LINKED_PAGES = J.pages() + ["tests/README.md"]
README_MAX_LINES = 250
RESULTS_MAX_FILES = 20
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.tdist_only
@pytest.mark.parametrize("page", J.pages())
@pytest.mark.parametrize("world_size", [2], ids=["ws2"])
def test_every_python_block_runs(pool, seed, page):
    blocks = J.python_blocks(page)
    for block in blocks:
        assert not block.runs or block.marker in ("", *J.CHECKS), \
            f"{block.name}: unknown marker <!-- {block.marker} --> (known: {J.NOT_RUN} ..., {', '.join(J.CHECKS)})"
    runnable = [b.name for b in blocks if b.runs]
    if not runnable:
        return  # (every block is marked; nothing to start ranks for)
    for rank, ran in enumerate(pool.run(J.run_page, seed, page, timeout=180)):
        assert ran == runnable, f"rank {rank} ran {ran}, expected every unmarked block: {runnable}"


def _anchors(path: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    slugs = set()
    for line in open(path).read().splitlines():
        heading = re.match(r"^#+\s+(.*)$", line)
        if heading:
            text = re.sub(r"[`*_]", "", heading.group(1)).strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return slugs


def test_relative_links_resolve():
    broken = []
    for page in LINKED_PAGES:
        text = open(os.path.join(J.ROOT, page)).read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # (code is not links)
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto: ...
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(J.ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(J.ROOT, page)
            if not os.path.exists(full):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in _anchors(full):
                broken.append(f"{page}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_and_results_stay_small():
    lines = len(open(os.path.join(J.ROOT, "README.md")).read().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; docs/ is the place for more"
    results = os.listdir(os.path.join(J.ROOT, "benchmarks", "results"))
    assert len(results) <= RESULTS_MAX_FILES, \
        f"benchmarks/results holds {len(results)} files: keep one current file per benchmark and machine"
