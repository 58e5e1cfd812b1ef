"""python -m servers [Hydra overrides], e.g. `python -m servers server=engine policy=continuous policy.max_running=64
port=8000`, `server=naive`, or `server=batcher server.max_batch=16 server.max_wait_ms=50`.
Binds 127.0.0.1 unless told otherwise (host=0.0.0.0).

SIGTERM drains: new requests get 503 and /health says "draining"; requests in flight get server.shutdown_grace_s
seconds to finish, then end with an error event; the process exits 0.
"""
import os
import signal
import sys
import threading

import uvicorn

from engine import threads
from engine.factory import build_engine
from engine.model.loader import eos_ids, pad_id
from pipeline import isa
from pipeline.config import compose_config, kv_spec, load_net, load_source, policy_spec
from servers.app import create_app
from servers.connections import uvicorn_config
from servers.generate_worker import GenerateWorker
from servers.worker import EngineWorker


def build(cfg):
    """The app for a composed config: the model, the engine with the configured policy, its worker thread."""
    threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
    load = load_net if cfg.server.name == "engine" else load_source
    model, tokenizer = load(cfg)
    if tokenizer is None:
        raise SystemExit(f"model {cfg.model.name} has no tokenizer; serve a model with one (e.g. model=tiny-chat)")
    srv = cfg.server
    if srv.name == "engine":
        engine = build_engine(model, policy_spec(cfg.policy), int(srv.max_request_tokens), eos_ids=eos_ids(model),
                              seed=int(cfg.seed), kv=kv_spec(cfg.kv))
        worker = EngineWorker(engine, int(srv.max_waiting))
    else:
        worker = GenerateWorker(model, eos_ids(model), int(srv.max_request_tokens), int(srv.max_batch),
                                float(srv.max_wait_ms), int(srv.max_waiting), pad_id(tokenizer))
    key = os.environ.get(cfg.server.api_key_env) if cfg.server.api_key_env else None
    return create_app(worker, tokenizer, cfg.model.name, key, int(cfg.server.default_max_tokens),
                      float(srv.max_queue_wait_s), int(srv.max_body_bytes)), worker


def main(argv: list[str]):
    """HTTP in a thread, the engine loop in the main thread (where torch's thread pool lives)."""
    overrides = [f"server.{a}" if a.split("=")[0] in ("port", "host") else a for a in argv]
    cfg = compose_config(overrides)
    isa.apply(cfg.isa)  # before torch does any work: torch, MKL and oneDNN read it once
    app, worker = build(cfg)
    srv = cfg.server
    server = uvicorn.Server(uvicorn_config(app, srv.host, int(srv.port), max_connections=int(srv.max_connections),
                                           read_timeout_s=float(srv.read_timeout_s),
                                           send_timeout_s=float(srv.send_timeout_s),
                                           max_unread_bytes=int(srv.max_unread_bytes)))
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    grace = float(cfg.server.shutdown_grace_s)
    signal.signal(signal.SIGTERM, lambda *_: worker.drain(grace))  # runs in this (the main) thread, between steps
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)


if __name__ == "__main__":
    main(sys.argv[1:])
