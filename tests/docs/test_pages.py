"""The pages as a course: every page opens with what the reader can do after it and closes with
3-5 questions whose answers are in docs/exercises/solutions/answers.md; the pages of the core
path (the index's reading order) average at most 25 words a sentence; and the first code block of
every page either runs as shown in a fresh interpreter, from a folder outside the repository, or
is labelled with the file it comes from and a ``python ...`` command that runs it."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

import snippets

DOCS = snippets.DOCS
ROOT = snippets.ROOT
ANSWERS = DOCS / "exercises" / "solutions" / "answers.md"
#: generated or hub pages: no goals, no questions
NOT_A_LESSON = {"index.md", "resources.md"}
MAX_WORDS_PER_SENTENCE = 25

FENCE = re.compile(r"^(```+|~~~+)")
ITEM = re.compile(r"^\s*(?:[*-]|\d+\.)\s+")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*(\[$\"'0-9])")
REPO_PATH = re.compile(r"`((?:numba_flash|tests|docs|examples|bench)(?:/[\w.-]+)*)`")
COMMAND = re.compile(r"`(python [^`]+)`")


def lessons():
    return [p for p in snippets.default_pages() if p.name not in NOT_A_LESSON]


def core_path():
    """The pages of the index's reading-order table, in order."""
    text = (DOCS / "index.md").read_text().split("## Reading order", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| \d+ \| \[[^\]]+\]\(([\w-]+\.md)\)", text, re.M)


# -- words per sentence ---------------------------------------------------------------------------
def prose(text):
    """The page's running text: no code blocks, display math, tables, headings, images or
    HTML comments; list items and paragraphs separated by blank lines."""
    out, fenced, math_block = [], False, False
    for line in text.splitlines():
        s = line.strip()
        if FENCE.match(s):
            fenced = not fenced
            out.append("")
        elif fenced:
            continue
        elif math_block or s.startswith("$$"):
            if s.count("$$") % 2:
                math_block = not math_block
            out.append("")
        elif s.startswith(("<!--", "|", "#", "![")):
            out.append("")
        else:
            out.append(("\n" if ITEM.match(line) else "") + line)
    return "\n".join(out)


def sentence_lengths(text):
    """Words per sentence: a sentence ends at ``.``, ``!`` or ``?`` followed by a capital, a
    digit, a code span or a formula; every paragraph and list item ends one."""
    lengths = []
    for para in re.split(r"\n\s*\n", prose(text)):
        para = ITEM.sub("", " ".join(para.split()))
        lengths += [len(s.split()) for s in SENTENCE_END.split(para) if s.split()]
    return lengths


def test_sentence_counter_counts():
    text = ("# T\n\nOne two three. Four five `x.y` six seven!\n\n* item one\n* item two two.\n\n"
            "```python\nnot. counted. at all.\n```\n\n$$ a. b. $$\n\n| a. | b. |\n")
    assert sentence_lengths(text) == [3, 5, 2, 3]


@pytest.mark.parametrize("name", core_path())
def test_core_path_sentences_average_at_most_25_words(name):
    lengths = sentence_lengths((DOCS / name).read_text())
    mean = sum(lengths) / len(lengths)
    assert mean <= MAX_WORDS_PER_SENTENCE, (
        f"{name}: {mean:.1f} words per sentence over {len(lengths)} sentences (the longest "
        f"{max(lengths)}); the core path keeps to {MAX_WORDS_PER_SENTENCE}")


def test_core_path_is_the_index_order():
    assert core_path()[:2] == ["attention-numpy.md", "cuda-basics.md"]
    assert "tiled-forward.md" in core_path() and "optimised-forward.md" not in core_path()


# -- goals and questions --------------------------------------------------------------------------
def questions(text):
    """The numbered items of the page's last section, which must be ``## Questions``."""
    last = text.rsplit("\n## ", 1)[1]
    assert last.startswith("Questions\n"), "the last section is not '## Questions'"
    return re.findall(r"^\d+\. ", last, re.M)


def answers():
    """``{page: number of answers}`` from docs/exercises/solutions/answers.md."""
    found = {}
    for section in ANSWERS.read_text().split("\n## ")[1:]:
        head, _, body = section.partition("\n")
        page = re.search(r"\(\.\./\.\./([\w-]+\.md)\)", head).group(1)
        found[page] = len(re.findall(r"^\d+\. ", body, re.M))
    return found


@pytest.mark.parametrize("page", lessons(), ids=lambda p: p.name)
def test_page_opens_with_goals_and_closes_with_answered_questions(page):
    text = page.read_text()
    head = text.split("\n## ", 1)[0]
    assert "After this page you can" in head, f"{page.name}: no goals before the first section"
    n = len(questions(text))
    assert 3 <= n <= 5, f"{page.name}: {n} questions (3 to 5)"
    assert answers().get(page.name) == n, f"{page.name}: {n} questions, answers.md has " \
                                           f"{answers().get(page.name)}"


def test_answers_cover_only_pages_that_exist():
    assert set(answers()) <= {p.name for p in lessons()}


# -- the first code block -------------------------------------------------------------------------
def first_block(text):
    """``(language, code, label)``: the first fenced block and the paragraph before it (the
    directive line that generates the block skipped); None for a page without one."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if FENCE.match(line)), None)
    if start is None:
        return None
    end = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i]))
    above = [ln for ln in lines[:start] if not snippets.DIRECTIVE.match(ln)]
    label = []
    for line in reversed(above):
        if not line.strip():
            if label:
                break
            continue
        label.insert(0, line)
    return lines[start].strip("`~ "), "\n".join(lines[start + 1:end]), " ".join(label)


def is_label(label):
    """A label names a file of the repository and a ``python ...`` command that runs it (the
    file may be the command's script)."""
    commands = COMMAND.findall(label)
    words = [w for c in commands for w in c.split()] + REPO_PATH.findall(label)
    paths = [w for w in words if REPO_PATH.fullmatch(f"`{w}`") and (ROOT / w).exists()]
    return bool(commands) and bool(paths)


_RUNNER = []


def _runner():
    """One :class:`snippets.Runner` for the module (pytest changes ``PYTEST_CURRENT_TEST`` in
    the environment per test, which ``snippets.runner`` would take for a new environment)."""
    if not _RUNNER:
        env = snippets._env(ROOT, foreign=False)
        env.pop("PYTEST_CURRENT_TEST", None)
        _RUNNER.append(snippets.Runner(env))
        snippets._RUNNERS[("tests/docs/test_pages.py",)] = _RUNNER[0]  # closed at exit
    return _RUNNER[0]


@pytest.mark.parametrize("page", snippets.default_pages(), ids=lambda p: p.name)
def test_first_block_runs_as_shown_or_is_labelled(page):
    block = first_block(page.read_text())
    if block is None:  # a table only (resources.md)
        return
    lang, code, label = block
    if is_label(label):
        return
    assert lang == "python", (
        f"{page.name}: the first block ({lang}) neither runs nor is labelled with its file and "
        f"a `python ...` command")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "first_block.py"
        script.write_text(code + "\n")
        rc, out, err = _runner().run(["python", str(script)], cwd=tmp)
    assert rc == 0, f"{page.name}: the first block fails in a fresh interpreter:\n{err[-2000:]}"
