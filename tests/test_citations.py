"""Code cites what a reader can open: no file outside the repository, no README section that moved to docs/, and
every README or docs/ section it names is a heading that file has."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The original sources (config file and key, paper) are cited instead of these; an issue's text is not in the
# repository either.
DEAD_CITATIONS = ("REFERENCE.md", "README: Versions", "README, bench", "README, Data", "the issue's")
# `README: Section` or `docs/name.md: Section`, as a comment or message points a reader to a section.
SECTION_POINTER = re.compile(r"\b(README|docs/[\w-]+\.md): ([^\n]*)")


def cited_files() -> list[Path]:
    files = [path for folder in ("cram", "recipes", "scripts", "tests", ".ci") for path in (REPO / folder).rglob("*")
             if path.is_file() and path.suffix in ("", ".py", ".sh", ".yaml")]
    return [path for path in files + [REPO / "Makefile", REPO / "pyproject.toml"] if path != Path(__file__).resolve()]


def headings(markdown: Path) -> list[str]:
    """The section titles of a markdown file, outside its code blocks."""
    titles, fenced = [], False
    for line in markdown.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            titles.append(line.lstrip("#").strip())
    return titles


def test_no_code_cites_a_file_outside_the_repository_or_a_moved_readme_section():
    cited = [f"{path.relative_to(REPO)}: {dead}" for path in cited_files()
             for dead in DEAD_CITATIONS if dead in path.read_text(errors="replace")]
    assert not cited, cited


def test_every_readme_or_docs_section_code_points_to_exists():
    dead = []
    for path in cited_files():
        for match in SECTION_POINTER.finditer(path.read_text(errors="replace")):
            target = REPO / ("README.md" if match[1] == "README" else match[1])
            named = match[2]
            if not target.is_file() or not any(
                    re.match(re.escape(title) + r"(\W|$)", named) for title in headings(target)):
                dead.append(f"{path.relative_to(REPO)}: {match[0]}")
    assert not dead, dead
