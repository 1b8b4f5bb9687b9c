"""The documentation holds together: every relative link in README.md and docs/*.md points to a
file that exists (and, into a Markdown page, to a heading it has), and every docs page is linked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """``page`` without its fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^\s*```.*?^\s*```[ \t]*$", "", page.read_text(), flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The heading anchors a repository host makes for ``page`` (GitHub's rule: lower case, inline
    code unquoted, punctuation but ``-`` and ``_`` dropped, spaces as ``-``, repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^\s*```.*?^\s*```[ \t]*$", "", page.read_text(),
                                                        flags=re.M | re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {dest.name})")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme_and_the_index():
    readme = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    index = {(ROOT / "docs" / t.partition("#")[0]).resolve() for t in links(ROOT / "docs" / "README.md")}
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert page.resolve() in index, f"docs/README.md does not link {page.name}"
            assert page.resolve() in readme, f"README.md does not link docs/{page.name}"


def test_the_readme_is_a_pitch_not_a_manual():
    """README.md stays short (the issue's ~300 lines); its Quick start is the two commands only."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    quick = text[text.index("## Quick start\n"):text.index("\n## ", text.index("## Quick start\n") + 1)]
    commands = [ln.split("#")[0].strip() for ln in quick.splitlines()[1:] if ln.strip() and not ln.startswith("```")]
    assert commands == ["bash scripts/quickstart.sh", ".venv/bin/python -m pytest -q"]


def test_every_extra_is_in_the_install_table_and_the_install_page():
    """pyproject.toml's extras, each named in the README's table and on docs/install.md."""
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "README.md").read_text(), re.M))
    install = (ROOT / "docs" / "install.md").read_text()
    assert set(extras) <= table, set(extras) - table
    assert [e for e in extras if f"`{e}`" not in install] == []


def test_the_tour_says_how_to_reach_its_commands_and_its_folder(tmp_path):
    """After the Quick start, the tour's first command works as written once the reader does what
    the text before it says: activate .venv (the commands are not on PATH) and make ``photos``
    the quick start's sample tree, whose image count the text names, as ``shardpack demo`` makes it."""
    from click.testing import CliRunner

    from shardpack.cli import main
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A five-minute tour\n"):]
    before = tour[:tour.index("pack-dataset photos")]
    assert "source .venv/bin/activate" in before and ".venv/bin/pack-dataset" in before
    assert "ln -s demo-out/sample photos" in before
    said = int(re.search(r"on the (\d+) images the quick start made", before).group(1))
    work = tmp_path / "demo-out"  # the quick start's `shardpack demo` (scripts/quickstart.sh), its default workdir
    assert "shardpack demo" in (ROOT / "scripts" / "quickstart.sh").read_text()
    r = CliRunner().invoke(main, ["demo", "--workdir", str(work), "--format", "npy"])
    assert r.exit_code == 0, r.output
    images = [p for p in (work / "sample").rglob("*") if p.is_file()]
    assert len(images) == said, (len(images), said)
