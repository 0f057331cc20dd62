"""The README as a user meets it (issues 25 and 43): its two opening shell blocks are the ones CI runs, its Python
snippets run from any directory, its converter example runs, every relative link in it and in docs/ resolves, and
every figure of its results table is quoted from the result file the row links."""

import os
import re
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_tiny_k2")
FENCE = re.compile(r"^```(\S*)\s*$", re.M)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\S*)\n(.*?)^```\s*$", text, re.M | re.S)]


def test_readme_opens_with_the_two_bash_blocks_ci_runs():
    blocks = fenced_blocks(read(README))
    assert [lang for lang, _ in blocks[:2]] == ["bash", "bash"], "the README must open with two ```bash blocks"
    assert [lang for lang, _ in blocks].count("bash") == 2, "other shell examples use ```console: .ci/run counts bash"
    install_and_generate, install_and_test = blocks[0][1], blocks[1][1]
    assert "pip install -e .\n" in install_and_generate and "python -m kdtree_jax.generate" in install_and_generate
    assert 'pip install -e ".[dev,serve]"' in install_and_test and "python -m pytest" in install_and_test
    # CI runs what .ci/run's own awk program extracts: it must be the second block, whole.
    awk = re.search(r"awk '([^']*)' README.md", read(os.path.join(ROOT, ".ci", "run"))).group(1)
    extracted = subprocess.run(["awk", awk, README], capture_output=True, text=True, check=True).stdout
    assert extracted == install_and_test


def test_readme_stays_a_product_page():
    # The details live in docs/ (usage, benchmarks, design, the kernel note); the README says what it is, how to
    # install and start, and the headline results.
    words = len(read(README).split())
    assert words <= 1500, f"README.md has {words} words; move detail to docs/"


def markdown_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [README, os.path.join(ROOT, "benchmarks", "results", "README.md")] + sorted(
        os.path.join(docs, name) for name in os.listdir(docs) if name.endswith(".md"))


def relative_links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # links inside code blocks are not links
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_point_at_files(path):
    links = relative_links(read(path))
    assert links or path != README
    missing = [t for t in links if not os.path.exists(os.path.join(os.path.dirname(path), t.split("#")[0]))]
    assert not missing, f"{os.path.relpath(path, ROOT)} links to missing files: {missing}"


def results_rows() -> list[list[str]]:
    section = read(README).split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| what ")]
    assert 1 <= len(rows) <= 8, "the README's results table holds one to eight rows"
    return rows


@pytest.mark.parametrize("row", results_rows(), ids=lambda r: r[0][:40])
def test_results_table_quotes_its_result_file(row):
    what, ours, reference, source = row
    link = re.search(r"\]\(([^)]+)\)", source).group(1)
    text = read(os.path.join(ROOT, link))
    commit = re.search(r"\b[0-9a-f]{7}\b", source).group(0)
    assert commit in text[:2000], f"{link} does not name commit {commit} in its first lines"
    quoted = re.findall(r"\d+\.\d+", ours + " " + reference)
    assert quoted, what
    absent = [n for n in quoted if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", text)]
    assert not absent, f"{what}: {absent} are not in {link}"


def python_snippets() -> list[str]:
    snippets = [body for lang, body in fenced_blocks(read(README)) if lang == "python"]
    assert len(snippets) == 2, "the quick start and the models-of-your-own snippets"
    return snippets


def run_snippet(code: str, cwd) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"the README snippet failed from {cwd}:\n{out.stderr[-3000:]}"
    return out.stdout


def test_quick_start_snippet_runs_from_another_directory(tmp_path):
    code = python_snippets()[0]
    assert "checkpoints/default" not in code  # a relative path works only in the repository
    code = code.replace("max_new_tokens=64", "max_new_tokens=8")
    stdout = run_snippet(code, tmp_path)
    text, stats = stdout.rstrip("\n").rsplit("\n", 1)
    assert text.strip(), "no continuation printed"
    tau, tokens_per_second = map(float, stats.split())
    assert tau >= 1.0 and tokens_per_second > 0


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (forced CPU devices, as the snippet sets up)")
def test_models_of_your_own_snippet_runs_from_another_directory(tmp_path):
    code = python_snippets()[1]
    code += ("\nassert logits.shape[:2] == (1, 4)\nassert sharded.mesh.size == 4 and target.mesh.size == 4\n"
             "print('ok')\n")
    assert run_snippet(code, tmp_path).strip() == "ok"


def test_converter_example_runs_on_the_tiny_hf_fixture(tmp_path):
    command = next(line for lang, body in fenced_blocks(read(README)) if lang == "console"
                   for line in body.splitlines() if "kdtree_jax.convert_hf" in line)
    args = command.split("#")[0].split()
    assert args[:3] == ["python", "-m", "kdtree_jax.convert_hf"]
    args[3:5] = [FIXTURE, str(tmp_path / "converted")]
    out = subprocess.run([sys.executable] + args[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.listdir(tmp_path / "converted")
