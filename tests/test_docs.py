"""The documentation matches the tree: docs/cuda.md's index of csrc/ lists every source file, and only files that
exist."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = {".cpp", ".cu", ".cuh", ".h", ".inc"}


def indexed_files():
    """The csrc/ paths named in the first column of the tables of docs/cuda.md's "Files of csrc/" section."""
    text = (ROOT / "docs" / "cuda.md").read_text()
    section = re.search(r"^## Files of csrc/\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, "docs/cuda.md has no '## Files of csrc/' section"
    paths = []
    for row in re.finditer(r"^\| *([^|]+?) *\|", section.group(1), re.MULTILINE):
        paths += re.findall(r"`(csrc/[^`]+)`", row.group(1))
    return paths


def test_every_indexed_file_exists():
    paths = indexed_files()
    assert paths, "the index of csrc/ is empty"
    assert len(paths) == len(set(paths)), sorted(p for p in paths if paths.count(p) > 1)
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"docs/cuda.md lists files that do not exist: {missing}"


def test_every_source_file_is_indexed():
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in SOURCE_SUFFIXES}
    unlisted = sorted(sources - set(indexed_files()))
    assert not unlisted, f"source files missing from docs/cuda.md's index of csrc/: {unlisted}"


def test_file_references_in_sources_exist():
    """Comments that name a file of the tree (csrc/..., docs/..., cpu/x.cpp, ...) name one that exists."""
    pattern = re.compile(r"\b((?:csrc/|docs/|benchmarks/|tests/)?(?:cpu|cuda|delta_rule|inst)/[\w/]+\.(?:cpp|cu|cuh|h|inc)"
                         r"|(?:csrc|docs|benchmarks|tests)/[\w/]+\.(?:cpp|cu|cuh|h|inc|md|py))\b")
    bad = []
    for src in (ROOT / "csrc").rglob("*"):
        if src.suffix not in SOURCE_SUFFIXES:
            continue
        comments = "\n".join(line.split("//", 1)[1] for line in src.read_text().splitlines() if "//" in line)
        for ref in pattern.findall(comments):
            candidates = [ROOT / ref, ROOT / "csrc" / ref, src.parent / ref, src.parent.parent / ref]
            if not any(c.is_file() for c in candidates):
                bad.append(f"{src.relative_to(ROOT)}: {ref}")
    assert not bad, f"comments name files that do not exist: {bad}"
