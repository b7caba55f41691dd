"""Code cites what a reader can open: no file outside the repository, no README section that moved to docs/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The original sources (config file and key, paper) are cited instead of these.
DEAD_CITATIONS = ("REFERENCE.md", "README: Versions", "README, bench", "README, Data")


def test_no_code_cites_a_file_outside_the_repository_or_a_moved_readme_section():
    files = [path for folder in ("cram", "recipes", "scripts", "tests", ".ci") for path in (REPO / folder).rglob("*")
             if path.is_file() and path.suffix in ("", ".py", ".sh", ".yaml")] + [REPO / "Makefile"]
    cited = [f"{path.relative_to(REPO)}: {dead}" for path in files if path != Path(__file__).resolve()
             for dead in DEAD_CITATIONS if dead in path.read_text(errors="replace")]
    assert not cited, cited
