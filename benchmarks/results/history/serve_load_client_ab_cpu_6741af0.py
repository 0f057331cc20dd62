"""A/B of the load client against serve_load.py's stand-in server (the real app, no model): the client at 97239bc
(one httpx pool shared by every stream) vs the client at HEAD (a pool per stream; 1 and 2 processes)."""
import asyncio, importlib.util, json, os, subprocess, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")); 
import serve_load, httpx
import tempfile
OLD = os.environ.get("OLD_SERVE_LOAD")  # a copy of 97239bc's serve_load.py where git cannot show it
if not OLD:
    OLD = os.path.join(tempfile.mkdtemp(), "serve_load_old.py")
    with open(OLD, "w") as f:  # the client as it was
        f.write(subprocess.run(["git", "show", "97239bc:benchmarks/serve_load.py"], capture_output=True,
                               text=True, check=True).stdout)
spec = importlib.util.spec_from_file_location("serve_load_old", OLD)
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

if __name__ == "__main__":
    port = serve_load._free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "serve_load.py"), "--stand-in-port", str(port),
                             "--max-batch", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try: httpx.get(url + "/v1/models", timeout=1); break
        except Exception: time.sleep(0.1)
    from kdtree_jax.generate import DEFAULT_CHECKPOINT
    docs = serve_load.corpus_docs(os.path.join(DEFAULT_CHECKPOINT, "tokenizer"), 65)
    reqs = serve_load.make_requests(64, (8, 64), (16, 96), 0, docs) * 4
    runs = {"97239bc shared pool": lambda: asyncio.run(old.run_level(url, reqs, 16, "stand-in")),
            "HEAD, 1 process": lambda: serve_load.drive(url, reqs, 16, "stand-in", processes=1),
            "HEAD, 2 processes": lambda: serve_load.drive(url, reqs, 16, "stand-in", processes=2)}
    out = {k: [] for k in runs}
    for r in range(int(sys.argv[1])):
        for name, run in runs.items():
            s0 = cpu(proc.pid)
            res, wall, _ = run()
            tok = sum(x["tokens"] for x in res)
            out[name].append({"tokens_per_s": tok / wall, "server_cpu_s": cpu(proc.pid) - s0, "wall_s": wall,
                              "errors": sum("error" in x for x in res)})
            print(r, name, f"{tok / wall:.0f} tok/s, server CPU {out[name][-1]['server_cpu_s']:.2f} s over {wall:.2f} s", flush=True)
    proc.terminate(); proc.wait()
    json.dump({"loadavg": os.getloadavg(), "runs": out}, open(sys.argv[2], "w"), indent=1)
