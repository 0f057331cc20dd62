"""Issue 25 item 5: corrupt or truncated weights are one-line errors naming the file (convert_hf, load_hf,
load_checkpoint, generate --checkpoint), and a failed conversion leaves no output directory behind."""

import os
import shutil

import pytest

import kdtree_jax
from kdtree_jax import convert_hf
from kdtree_jax.generate import main as generate_main

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny_k2")


def _hf_copy(tmp_path, damage) -> str:
    d = tmp_path / "hf"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(FIXTURE, f), d / f)
    damage(str(d / "model.safetensors"))
    return str(d)


def _garbage(path):
    with open(path, "r+b") as f:
        f.write(b"\xff" * 64)  # the header length becomes 2**64 - 1


def _garbled_header(path):
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"}{not json")


def _truncated(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _tiny(path):
    with open(path, "wb") as f:
        f.write(b"abc")


@pytest.mark.parametrize("damage, why", [(_garbage, "truncated or not safetensors"), (_garbled_header, "not JSON"),
                                         (_truncated, "truncated"), (_tiny, "shorter than the 8-byte")])
def test_convert_names_the_bad_file_and_writes_nothing(tmp_path, capsys, damage, why):
    hf = _hf_copy(tmp_path, damage)
    out = tmp_path / "out"
    assert convert_hf.main([hf, str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "model.safetensors" in err[0] and why in err[0]
    assert not out.exists()
    with pytest.raises(ValueError, match="model.safetensors is not a valid safetensors file"):
        kdtree_jax.load_hf(hf)


def test_generate_on_a_bad_hf_directory_is_one_line(tmp_path, capsys):
    hf = _hf_copy(tmp_path, _truncated)
    with pytest.raises(SystemExit) as e:
        generate_main(["--prompt", "x", "--checkpoint", hf])
    assert e.value.code == 1  # a damaged file: the data is wrong, not the command
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "model.safetensors" in err[-1] and "truncated" in err[-1]
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(SystemExit):
        generate_main(["--prompt", "x", "--checkpoint", hf])
    assert "config.json cannot be read as JSON" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_conversion_that_fails_midway_removes_its_output(tmp_path, monkeypatch):
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*args, **kwargs)

    real = convert_hf.convert_param
    monkeypatch.setattr(convert_hf, "convert_param", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        convert_hf.convert_checkpoint(FIXTURE, str(out), piece_bytes=1, progress=False)
    assert not out.exists()
    out.mkdir()  # an empty directory given by the user stays, empty
    calls.clear()
    with pytest.raises(OSError):
        convert_hf.convert_checkpoint(FIXTURE, str(out), piece_bytes=1, progress=False)
    assert out.exists() and os.listdir(out) == []


def test_corrupt_orbax_checkpoint_names_the_piece(tmp_path, capsys):
    cfg = kdtree_jax.ModelConfig.preset("tiny")
    path = str(tmp_path / "ckpt")
    kdtree_jax.save_checkpoint(path, kdtree_jax.init_model(cfg, seed=0))
    # Truncate the target piece's array data (TensorStore's data files, under d/), its metadata intact.
    piece = os.path.join(path, "target", "params")
    for root, _, files in os.walk(piece):
        for f in files:
            if os.path.basename(root) == "d":
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(os.path.getsize(os.path.join(root, f)) // 3)
    with pytest.raises(ValueError, match=r"target/params/state/(ocdbt\.process_0/)?d/\w+ \(target piece params\) is truncated: ") as e:
        kdtree_jax.load_checkpoint(path)
    assert "\n" not in str(e.value)
    with open(os.path.join(piece, "_CHECKPOINT_METADATA"), "r+b") as fh:  # and its Orbax metadata garbled
        fh.truncate(20)
    with pytest.raises(ValueError, match=r"target/params\S* \(target piece params\) is (corrupt or )?truncated: ") as e:
        kdtree_jax.load_checkpoint(path)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        generate_main(["--prompt", "x", "--checkpoint", path])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "target/params" in err[-1]
    with open(os.path.join(path, "kdtree_checkpoint.json"), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match="kdtree_checkpoint.json cannot be read as JSON"):
        kdtree_jax.load_checkpoint(path)
