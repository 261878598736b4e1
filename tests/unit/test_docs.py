"""The documentation stays a reader's: links resolve, the README stays short, nothing points outside.

A reader of this repository has its files and nothing else: every relative link in the user-facing
Markdown must reach a file or folder of the checkout, and no tracked file may send the reader to a
folder beside the repository or to an issue tracker they cannot see.
"""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250

# `[text](target)`; the target ends at whitespace or the closing parenthesis (titles are not used).
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
EXTERNAL = re.compile(r"^(https?:|mailto:|ftp:)", re.IGNORECASE)
# Code is not prose: brackets and parentheses inside it are no links.
FENCED_CODE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")

# The folder beside the checkout (its design notes, its vLLM notes) and the tracker's numbers are
# spelled from parts, so that this file does not itself contain what it forbids.
OUTSIDE = "shared"
TRACKER_WORD = "issue"

# `OUTSIDE/DESIGN.md`, `OUTSIDE/VLLM_CPU_NOTES.md`, `../OUTSIDE`; not `/dev/shm`, "shared memory",
# or an absolute path on some cluster's filesystem.
OUTSIDE_FOLDER = re.compile(
    rf"(?<![\w/.-]){OUTSIDE}/(DESIGN|VLLM)|\.\./{OUTSIDE}\b|(?<![\w/.-]){OUTSIDE}/[\w.-]+\.md\b"
)
# A tracker's item by number, with or without `#`, singular or plural; upstream "PR #123" is not.
TRACKER_REFERENCE = re.compile(rf"\b{TRACKER_WORD}s? ?#?\d+\b", re.IGNORECASE)


def checked_markdown() -> list[Path]:
    files = [REPO / "README.md", REPO / "CONTRIBUTING.md"]
    for folder in ("docs", "bench", "deploy"):
        files.extend(sorted((REPO / folder).rglob("*.md")))
    return [f for f in files if f.is_file()]


def relative_links(text: str) -> list[str]:
    """Link targets that name a path in the checkout: not a URL, not an anchor of the same page."""
    prose = INLINE_CODE.sub("", FENCED_CODE.sub("", text))
    targets = []
    for match in MARKDOWN_LINK.finditer(prose):
        target = match.group(1)
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        targets.append(target)
    return targets


def tracked_text_files() -> dict[str, str]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, text=True
    ).stdout.split("\0")
    texts = {}
    for name in names:
        path = REPO / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        texts[name] = data.decode("utf-8", errors="replace")
    return texts


def test_the_link_pattern_reads_what_markdown_means():
    text = "[a](docs/x.md) [b](../y.md#part) [c](https://e.org) [d](#here) [e](mailto:a@b) [f](z/ 'T')"
    text += "\n```python\nx = f[0](1)\n```\n `g[1](2)`"
    assert relative_links(text) == ["docs/x.md", "../y.md#part", "z/"]


def test_every_relative_link_resolves():
    broken = []
    for markdown in checked_markdown():
        for target in relative_links(markdown.read_text()):
            path = target.split("#", 1)[0]
            if not (markdown.parent / path).exists():
                broken.append(f"{markdown.relative_to(REPO)}: {target}")
    assert not broken, "links to nothing in the checkout:\n" + "\n".join(broken)


def test_readme_is_a_page_not_a_notebook():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, expected at most {README_MAX_LINES}: "
        "move details to docs/ and measurements to bench/reports/"
    )


def test_the_patterns_flag_only_what_they_mean():
    outside = (f"see {OUTSIDE}/DESIGN.md", f"({OUTSIDE}/VLLM_CPU_NOTES.md)", f"../{OUTSIDE}/notes")
    for text in outside:
        assert OUTSIDE_FOLDER.search(text), text
    for text in ("/dev/shm/x", "shared memory", "MODEL_DIR=/data/ckpt", f"/{OUTSIDE}/ckpt"):
        assert not OUTSIDE_FOLDER.search(text), text
    word = TRACKER_WORD
    for text in (f"{word} 30", f"{word.title()} #32", f"{word}s 19", f"({word}17)"):
        assert TRACKER_REFERENCE.search(text), text
    for text in ("vLLM PR #1234", f"an {word} with 3 ranks", f"{word}-free", f"t{word} 5"):
        assert not TRACKER_REFERENCE.search(text), text


def test_no_file_points_outside_the_repository_or_at_a_tracker():
    found = []
    for name, text in tracked_text_files().items():
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_FOLDER.search(line) or TRACKER_REFERENCE.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, (
        "lines that send the reader outside the repository (a folder beside it, an issue "
        "number); state the fact or link to docs/ instead:\n" + "\n".join(found)
    )
