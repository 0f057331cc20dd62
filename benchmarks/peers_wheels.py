"""Build `.whl/`: the two peer kernels benchmarks/peers.py times, as wheels small enough to travel to the GPU machine.

    python benchmarks/peers_wheels.py [--out .whl] [--work /tmp/peers_wheels] [--jobs 2]

Run it here (no GPU needed: nvcc 13 and a C++ compiler are); the device call (`benchmarks/gpu_peers.sh`) installs
what it leaves in `.whl/` into /tmp/site, as the device README's wheel paragraph says. Nothing is downloaded there.

Why not the registry's wheels as they are: the working tree that travels with a device call is at most 64 MiB,
the tracked tree is ~48 MiB of it (checkpoints/ alone 38), and flashinfer-python 0.7.2 is 62 MiB by itself (its
JIT sources: CUTLASS, CCCL, every kernel family's csrc). So:

- sgl-flash-mla 1.0.0 (9.4 MiB): the same wheel without `flash_mla/cuda.abi3.so`, upstream's current kernels,
  which are SM100-only; what peers.py calls is the frozen legacy extension `_C_legacy.abi3.so` (SM90 dense MLA
  decoding, op namespace `torch.ops.flash_mla_legacy`). Without cuda.abi3.so `import flash_mla` raises, so peers.py
  loads the legacy library itself (`torch.ops.load_library`) and calls its registered op `dense_decode_fwd`
  (the schema is printed by this script from the library's strings). The extension registers through PyTorch's
  stable ABI, so it loads on torch 2.11 (the wheel's metadata asks for torch>=2.14.1, which --no-deps ignores).
- flashinfer-python 0.7.2: FlashInfer compiles its kernels at first use (JIT, nvcc + ninja) from the sources in its
  wheel; instead the one module `BatchMLAPagedAttentionWrapper(backend="fa3")` loads for our shapes (bf16 q / kv / o,
  int32 indices, head_dim_ckv 512, head_dim_kpe 64, no profiler) is compiled here, ahead of time, by FlashInfer's own
  build recipe (its JitSpec: the nvcc flags, sm_90a, and ninja file it writes for a JIT build), with
  FLASHINFER_CUDA_ARCH_LIST=9.0a, and put where FlashInfer looks for a prebuilt module first
  (flashinfer/data/aot/<name>/<name>.so). The wheel keeps its Python package (what `import flashinfer` loads, all of
  flashinfer/jit and flashinfer/mla) and the four csrc files that building the module's spec reads (it copies them
  into its generated-source folder even when a prebuilt module is found); the rest of data/ (the JIT sources) is
  left out, so a module not built here cannot be JIT-compiled there (gpu_peers.sh sets FLASHINFER_DISABLE_JIT=1 so
  that such a miss fails at once with FlashInfer's own error). The module links libcudart.so.13 only (torch's).
  Compile time here: ~40 s of 2 cores (three .cu files); on the device it would be similar, but its sources do not
  fit the carry.
- apache-tvm-ffi 0.1.15.post2 (FlashInfer's FFI, not in the device image; 3.2 MiB): the same wheel without what
  nothing reads at run time (the libbacktrace sources, its C++ and Cython sources); its libraries (core links
  libtvm_ffi_testing.so too), its headers and dlpack.h stay (tvm-ffi JIT-builds a small torch addon with
  them where torch lacks the DLPack exchange API). The check below installs the same cut of the cp311 wheel (this
  machine's Python) and imports it.
Everything else FlashInfer imports is in the device image (KINDS.md's list: numpy, packaging, jinja2, filelock,
requests, tqdm, nvidia-ml-py, einops, tabulate, click, ninja).

The build venv (--work/venv) gets torch from this machine's /opt/wheels when there (a CPU build: only the Python
side of FlashInfer and the spec need torch; the module does not link it), flashinfer's full wheel, tvm-ffi and the
small packages above. libcuda.so is not on this machine (no driver): the link gets a stub with libcuda.so.1's soname
(the module does not end up needing it). At the end the wheels are installed into a scratch --target folder and
checked the way the device will use them: `import flashinfer`, the fa3 MLA spec resolves to the prebuilt module,
which loads (tvm-ffi) and exports plan and run; FlashMLA's legacy library is present.
"""

from __future__ import annotations

import argparse
import base64
import csv
import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLASHMLA = ("sgl-flash-mla", "1.0.0")
FLASHINFER = ("flashinfer-python", "0.7.2")
TVM_FFI = ("apache-tvm-ffi", "0.1.15.post2")
# What the device README's wheel paragraph passes to pip download (the device's Python is 3.12, x86-64).
DOWNLOAD_FLAGS = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                  "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                  "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
                  "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]
BUILD_VENV_PACKAGES = ["numpy", "packaging", "jinja2", "filelock", "requests", "tqdm", "nvidia-ml-py", "einops",
                       "tabulate", "click", "ninja"]
CARRY_LIMIT = 64 << 20
TVM_FFI_DROP = ("tvm_ffi/3rdparty/libbacktrace/", "tvm_ffi/src/", "tvm_ffi/cython/")

# Run inside the build venv: build the fa3 MLA module and report what `import flashinfer` and the spec touch.
BUILD_CHILD = r'''
import json, os, sys, time
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        opened.add(os.path.abspath(args[0]))
sys.addaudithook(hook)
import torch
import flashinfer
from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
import flashinfer.mla._batch_mla._backends.fa3_backend  # noqa: F401
from flashinfer.jit import gen_batch_mla_module
spec = gen_batch_mla_module("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 512, 64, False)
root = os.path.dirname(os.path.abspath(flashinfer.__file__))
loaded = sorted({os.path.abspath(m.__file__) for m in list(sys.modules.values())
                 if getattr(m, "__file__", None) and os.path.abspath(m.__file__).startswith(root + os.sep)})
touched = sorted(p for p in opened if p.startswith(root + os.sep))
t0 = time.time()
if not spec.jit_library_path.exists():
    spec.build()
print("BUILD_JSON " + json.dumps(dict(name=spec.name, library=str(spec.jit_library_path), root=root,
      loaded=loaded, touched=touched, build_s=round(time.time() - t0, 1))))
'''

# Run inside the build venv with PYTHONPATH=<the wheels installed with --target>: what the device will do.
CHECK_CHILD = r'''
import importlib.util, json, os, sys
import torch
import flashinfer
from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401
from flashinfer.jit import gen_batch_mla_module
spec = gen_batch_mla_module("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, 512, 64, False)
assert flashinfer.__file__.startswith(sys.argv[1]), flashinfer.__file__
import tvm_ffi
assert tvm_ffi.__file__.startswith(sys.argv[1]), tvm_ffi.__file__
assert spec.is_aot, "the prebuilt module is not where FlashInfer looks"
module = spec.try_load()
names = [n for n in ("plan", "run") if getattr(module, n, None) is not None]
fm = importlib.util.find_spec("flash_mla")
legacy = [p for p in os.listdir(os.path.dirname(fm.origin)) if p.startswith("_C_legacy")]
print("CHECK_JSON " + json.dumps(dict(flashinfer=flashinfer.__version__, aot=str(spec.aot_path), functions=names,
      flash_mla_dir=os.path.dirname(fm.origin), flash_mla_legacy=legacy)))
'''


def log(msg):
    print(f"[peers_wheels] {msg}", flush=True)


def run(cmd, **kw):
    log(" ".join(cmd) if len(" ".join(cmd)) < 300 else " ".join(cmd)[:300] + " ...")
    return subprocess.run(cmd, check=True, **kw)


def download(name, version, dest, python_version="3.12"):
    os.makedirs(dest, exist_ok=True)
    stem = name.replace("-", "_")
    tag = "cp" + python_version.replace(".", "")

    def found():
        return [p for p in glob.glob(os.path.join(dest, f"{stem}-{version}-*.whl"))
                if "-py3-none-" in p or "-abi3-" in p or f"-{tag}-" in p]
    if not found():
        flags = list(DOWNLOAD_FLAGS)
        flags[flags.index("--python-version") + 1] = python_version
        run([sys.executable, "-m", "pip", "download", *flags, "-d", dest, f"{name}=={version}"])
    assert len(found()) == 1, found()
    return found()[0]


def tvm_keep(name):
    return not any(name == d or name.startswith(d) for d in TVM_FFI_DROP)


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [arcname, f"sha256={digest}", str(len(data))]


def repack(src, dest, keep, extra=()):
    """A copy of wheel `src` at `dest` with the members `keep(name)` accepts plus `extra` [(arcname, bytes)], and a
    RECORD that lists them."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        members = [(n, zin.read(n)) for n in names if n != record and keep(n)]
    members += list(extra)
    rows = [record_line(n, data) for n, data in members] + [[record, "", ""]]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    tmp = dest + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for n, data in members:
            zout.writestr(n, data)
        zout.writestr(record, buf.getvalue())
    os.replace(tmp, dest)
    return dest


def flashmla_schema(wheel):
    """The legacy extension's registered schema of dense_decode_fwd (read from the library's strings)."""
    with zipfile.ZipFile(wheel) as z:
        data = z.read("flash_mla/_C_legacy.abi3.so")
    i = data.find(b"dense_decode_fwd(Tensor")
    return data[i:data.find(b"\0", i)].decode() if i >= 0 else None


def build_venv(work, python):
    venv = os.path.join(work, "venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        run([python, "-m", "venv", venv])
        local_torch = sorted(glob.glob("/opt/wheels/torch-*.whl"))
        tag = subprocess.run([py, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
                             capture_output=True, text=True, check=True).stdout.strip()
        torch_spec = [p for p in local_torch if f"-{tag}-" in p][-1:] or ["torch"]
        run([py, "-m", "pip", "install", "-q", *torch_spec])
        run([py, "-m", "pip", "install", "-q", f"{TVM_FFI[0]}=={TVM_FFI[1]}", *BUILD_VENV_PACKAGES])
    return py


def stub_libcuda(work):
    """An empty libcuda.so (soname libcuda.so.1) for the link step: this machine has no driver."""
    d = os.path.join(work, "cudastub")
    so = os.path.join(d, "libcuda.so")
    if not os.path.exists(so):
        os.makedirs(d, exist_ok=True)
        src = os.path.join(d, "stub.c")
        with open(src, "w") as f:
            f.write("void kdtree_jax_libcuda_stub(void) {}\n")
        run(["cc", "-shared", "-fPIC", "-o", so, "-Wl,-soname,libcuda.so.1", src])
    return d


def child_json(py, code, tag, env, args=()):
    out = subprocess.run([py, "-c", code, *args], env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    sys.stderr.write(out.stdout[-4000:] + out.stderr[-8000:])
    raise SystemExit(f"{tag}: the child failed (rc {out.returncode})")


def flashinfer_keep(rel, keep_files):
    """Members of the slim FlashInfer wheel: dist-info, the modules `import flashinfer` loaded, all of jit/ and mla/
    (Python only), and the files the spec reads."""
    if ".dist-info/" in rel:
        return True
    if rel in keep_files:
        return True
    if rel.endswith(".py") and (rel.startswith("flashinfer/jit/") or rel.startswith("flashinfer/mla/")
                                or rel.count("/") == 1):
        return True
    return False


def tree_bytes():
    """Bytes of what a device call sends besides carried paths: tracked files and untracked files git does not
    ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    total = 0
    for rel in out.decode().split("\0"):
        p = os.path.join(ROOT, rel)
        if rel and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, ".whl"), help="the wheels folder that travels")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "peers_wheels"),
                        help="downloads, the build venv, the build (kept: a rerun reuses them)")
    parser.add_argument("--python", default=shutil.which("python3.11") or sys.executable,
                        help="interpreter of the build venv (any CPython that /opt/wheels or pip has torch for)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="ninja jobs (MAX_JOBS)")
    args = parser.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    dl = os.path.join(args.work, "dl")
    fm_src = download(*FLASHMLA, dl)
    fi_src = download(*FLASHINFER, dl)
    tvm_src = download(*TVM_FFI, dl)

    # FlashMLA without the SM100 extension.
    fm_out = repack(fm_src, os.path.join(args.out, os.path.basename(fm_src)),
                    keep=lambda n: n != "flash_mla/cuda.abi3.so")
    log(f"FlashMLA legacy op: {flashmla_schema(fm_out)}")

    # FlashInfer: build the fa3 MLA module with the full wheel, then keep only what runs it.
    py = build_venv(args.work, args.python)
    run([py, "-m", "pip", "install", "-q", "--no-deps", fi_src])
    env = dict(os.environ, FLASHINFER_CUDA_ARCH_LIST="9.0a", FLASHINFER_WORKSPACE_BASE=os.path.join(args.work, "fi"),
               MAX_JOBS=str(args.jobs), CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"),
               LIBRARY_PATH=os.pathsep.join(filter(None, [stub_libcuda(args.work), os.environ.get("LIBRARY_PATH")])))
    built = child_json(py, BUILD_CHILD, "BUILD_JSON", env)
    log(f"FlashInfer module {built['name']}: {os.path.getsize(built['library'])} bytes (build {built['build_s']} s)")
    site = os.path.dirname(built["root"])
    keep_files = {os.path.relpath(p, site) for p in built["loaded"] + built["touched"]}
    with open(built["library"], "rb") as f:
        module = f.read()
    fi_out = repack(fi_src, os.path.join(args.out, os.path.basename(fi_src)),
                    keep=lambda n: flashinfer_keep(n, keep_files),
                    extra=[(f"flashinfer/data/aot/{built['name']}/{built['name']}.so", module)])
    tvm_out = repack(tvm_src, os.path.join(args.out, os.path.basename(tvm_src)), keep=tvm_keep)

    # Check the set as the device will install it.
    check = os.path.join(args.work, "check_site")
    shutil.rmtree(check, ignore_errors=True)
    # The check's interpreter is the build venv's: the same cut of tvm-ffi's wheel for its Python stands in for the
    # carried cp312 one (tested as a zip only).
    venv_tag = subprocess.run([py, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                              capture_output=True, text=True, check=True).stdout.strip()
    tvm_check = repack(download(*TVM_FFI, dl, python_version=venv_tag),
                       os.path.join(args.work, "tvm_check", os.path.basename(download(*TVM_FFI, dl, venv_tag))),
                       keep=tvm_keep) if venv_tag != "3.12" else tvm_out
    with zipfile.ZipFile(tvm_out) as z:
        assert z.testzip() is None
    run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
         "--target", check, fm_out, fi_out, tvm_check])
    check_env = dict(os.environ, PYTHONPATH=check, FLASHINFER_DISABLE_JIT="1", FLASHINFER_CUDA_ARCH_LIST="9.0a",
                     FLASHINFER_WORKSPACE_BASE=os.path.join(args.work, "fi_check"),
                     LD_LIBRARY_PATH=os.pathsep.join(filter(None, ["/usr/local/cuda/lib64",
                                                                   os.environ.get("LD_LIBRARY_PATH")])))
    checked = child_json(py, CHECK_CHILD, "CHECK_JSON", check_env, args=(check,))
    log(f"check: {json.dumps(checked)}")

    wheels = sorted(glob.glob(os.path.join(args.out, "*.whl")))
    sizes = {os.path.basename(w): os.path.getsize(w) for w in wheels}
    tree = tree_bytes()
    total = tree + sum(sizes.values())
    for name, size in sizes.items():
        log(f"{name}: {size / 2**20:.2f} MiB")
    log(f"tree {tree / 2**20:.1f} MiB + wheels {sum(sizes.values()) / 2**20:.1f} MiB = {total / 2**20:.1f} MiB "
        f"of the {CARRY_LIMIT >> 20} MiB a device call carries")
    with open(os.path.join(args.out, "MANIFEST.json"), "w") as f:
        json.dump(dict(wheels=sizes, flashinfer_module=built["name"], flashmla_schema=flashmla_schema(fm_out),
                       sha256={os.path.basename(w): hashlib.sha256(open(w, "rb").read()).hexdigest() for w in wheels},
                       built_with=dict(flashinfer=FLASHINFER[1], cuda_arch="9.0a",
                                       nvcc=subprocess.run(["nvcc", "--version"], capture_output=True,
                                                           text=True).stdout.strip().splitlines()[-1])), f, indent=1)
    if total > CARRY_LIMIT:
        raise SystemExit(f"too big to travel: {total / 2**20:.1f} MiB > {CARRY_LIMIT >> 20} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
