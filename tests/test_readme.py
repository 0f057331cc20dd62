"""Issue 25 item 4: the README's Python snippet runs as written (only the HuggingFace path, which names a model
too large to fetch here, is replaced by the tiny HF fixture, and the generation lengths are cut)."""

import os
import re

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_tiny_k2")


def readme_snippet() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no Python snippet"
    return blocks[0]


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (forced CPU) devices, as the snippet sets up")
def test_readme_python_snippet_runs(monkeypatch):
    code = readme_snippet()
    assert "path/to/Kimi-K2-Instruct" in code and "xla_force_host_platform_device_count=8" in code
    code = code.replace("path/to/Kimi-K2-Instruct", FIXTURE)
    code = code.replace("max_new_tokens=128", "max_new_tokens=4")
    monkeypatch.chdir(ROOT)  # the snippet names checkpoints/default relative to the repository
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["logits"].shape[:2] == (1, 4)
    assert len(namespace["res"].tokens[0]) == 4
    assert namespace["target"].mesh.size == 4 and namespace["sharded"].mesh.size == 8
