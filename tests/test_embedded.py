"""The embedded default pair (kdtree_jax.default_checkpoint) and the build's choices (ffi/cmake, ffi/third_party)."""

import glob
import importlib
import os
import re
import shutil
import subprocess

import pytest

import kdtree_jax
from kdtree_jax import embedded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FFI = os.path.join(ROOT, "ffi")


def test_default_checkpoint_is_a_loadable_pair_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the path must not depend on where the user stands
    path = kdtree_jax.default_checkpoint()
    assert os.path.isabs(path) and os.path.isfile(os.path.join(path, "kdtree_checkpoint.json"))
    target, drafter, tokenizer = kdtree_jax.load_checkpoint(path)
    assert drafter is not None and type(tokenizer).__name__ != "ByteTokenizer"
    assert tokenizer.decode(tokenizer.encode("def fibonacci(n):")) == "def fibonacci(n):"


def test_missing_default_pair_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(embedded, "_PLACES", (str(tmp_path / "a"), str(tmp_path / "b")))
    with pytest.raises(FileNotFoundError, match="embedded default pair is missing"):
        embedded.default_checkpoint()
    assert embedded.default_checkpoint(required=False) is None

    generate = importlib.import_module("kdtree_jax.generate")  # the CLI module (kdtree_jax.generate is the function)
    monkeypatch.setattr(generate, "DEFAULT_CHECKPOINT", None)
    with pytest.raises(SystemExit) as e:
        generate.load_models(None)  # the CLI's and the server's default: an error, never a random-init pair
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the embedded default pair is missing") and err.count("\n") == 1


def _cuda_choice(env_overrides, path_prefix=None):
    """Run ffi/cmake/cuda_choice.cmake under `cmake -P` with KDTREE_JAX_CUDA as given; (choice, reason) or the error."""
    script = os.path.join(path_prefix or os.environ.get("TMPDIR", "/tmp"), f"cuda_choice_{os.getpid()}.cmake")
    env = {k: v for k, v in os.environ.items() if k != "KDTREE_JAX_CUDA"}
    env.update(env_overrides)
    if path_prefix:
        env["PATH"] = path_prefix + os.pathsep + env["PATH"]
    code = (f'include("{FFI}/cmake/cuda_choice.cmake")\n'
            'kdtree_jax_cuda_choice(c)\nmessage(NOTICE "choice=${c}|${c_REASON}")\n')
    with open(script, "w") as f:
        f.write(code)
    r = subprocess.run(["cmake", "-P", script], env=env, capture_output=True, text=True, timeout=120)
    m = re.search(r"choice=(\w+)\|(.*)", r.stderr)
    return (m.group(1), m.group(2)) if m else ("error", r.stderr)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake on PATH")
def test_cuda_build_only_where_a_gpu_is_visible_or_asked(tmp_path):
    assert _cuda_choice({"KDTREE_JAX_CUDA": "ON"})[0] == "ON"
    assert _cuda_choice({"KDTREE_JAX_CUDA": "off"})[0] == "OFF"
    assert "must be ON, OFF or AUTO" in _cuda_choice({"KDTREE_JAX_CUDA": "maybe"})[1]
    # A GPU that nvidia-smi lists turns the default on.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    assert _cuda_choice({}, str(tmp_path)) == ("ON", "a GPU is visible (nvidia-smi -L)")
    assert _cuda_choice({"KDTREE_JAX_CUDA": "OFF"}, str(tmp_path))[0] == "OFF"
    if glob.glob("/dev/nvidia[0-9]*"):
        return
    # No GPU (nvidia-smi listing none, as with a driver but no device, or no nvidia-smi at all): the CPU handler only,
    # whether nvcc is on PATH or not.
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    assert _cuda_choice({}, str(tmp_path)) == ("OFF", "no GPU visible")
    assert _cuda_choice({"KDTREE_JAX_CUDA": "auto"}, str(tmp_path)) == ("OFF", "no GPU visible")


def _ffi_api_version(include_dir):
    with open(os.path.join(include_dir, "xla", "ffi", "api", "c_api.h")) as f:
        text = f.read()
    return tuple(int(re.search(rf"#define XLA_FFI_API_{part} (\d+)", text).group(1)) for part in ("MAJOR", "MINOR"))


def test_vendored_ffi_headers_match_the_installed_jaxlib():
    """An isolated build compiles against ffi/third_party's XLA FFI headers: the installed XLA must take handlers of
    that API version (same major, a minor no newer than its own). On a failure, copy jax.ffi.include_dir()'s xla/
    into ffi/third_party/."""
    import jax.ffi

    installed = jax.ffi.include_dir()
    if not os.path.exists(os.path.join(installed, "xla", "ffi", "api", "c_api.h")):
        pytest.skip("this jaxlib ships no XLA FFI headers")
    major, minor = _ffi_api_version(os.path.join(FFI, "third_party"))
    installed_major, installed_minor = _ffi_api_version(installed)
    assert major == installed_major and minor <= installed_minor
