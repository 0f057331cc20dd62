"""An OpenAI-compatible server over the DDTree decode loop (`python -m kdtree_jax.serve`; needs the `serve` extra).

    scheduler.py   the decode thread: continuous batching over engine.ChunkedLoop (buckets, admission, retirement)
    api.py         FastAPI: /v1/completions (SSE or whole), /v1/models, /health, /metrics; validation, errors
    metrics.py     counters and gauges, Prometheus text
    __main__.py    the command line: load, warm up, serve, drain on SIGINT/SIGTERM
"""
