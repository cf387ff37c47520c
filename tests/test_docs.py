"""The README stays a user's guide a newcomer can read (issue 44), and no page of the documentation
points at a file or a section that is not there."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 250

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a `[x](y)` inside code is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(page.read_text()).splitlines() if line.startswith("#")}


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines; keep it under {MAX_README_LINES} (details go to docs/)"


def test_readme_keeps_the_test_command_that_ci_runs():
    """`.ci/run` runs the first `pip install` line after the marker."""
    lines = README.read_text().splitlines()
    at = lines.index("<!-- test-command -->")
    assert lines[at + 1] == "```bash" and lines[at + 2].startswith("pip install ")
    assert "pytest" in lines[at + 2]


def test_docs_exist():
    names = {p.name for p in _pages()}
    assert {"architecture.md", "gpu.md", "training.md", "quantization.md"} <= names


def test_relative_links_point_at_files_and_sections_that_exist():
    broken = []
    for page in _pages():
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):       # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such section)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    """The check above would fail on a missing file or section (it is not vacuous)."""
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [gone](missing.md) [bad](#nowhere)\n```\n[code](not-a-link.md)\n```\n")
    targets = _LINK.findall(_prose(page.read_text()))
    assert targets == ["#top", "missing.md", "#nowhere"]
    assert _anchors(page) == {"top"}
    assert _slug("One decode step with speculation at PP = 2") == "one-decode-step-with-speculation-at-pp--2"
