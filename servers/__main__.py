"""python -m servers [Hydra overrides], e.g. `python -m servers server=engine policy=continuous policy.max_running=64
port=8000` (with speculative decoding: `speculative=ngram`), `server=naive`, `server=batcher server.max_batch=16
server.max_wait_ms=50`, or a router in front of engine servers:
`server=router server.policy=prefix_aware server.backends=[http://127.0.0.1:8001,http://127.0.0.1:8002]`
(no model of its own; uvicorn's own SIGTERM handling: requests in flight finish).
Binds 127.0.0.1 unless told otherwise (host=0.0.0.0).

SIGTERM drains: new requests get 503 and /health says "draining"; requests in flight get server.shutdown_grace_s
seconds to finish, then end with an error event; the process exits 0.
"""
import os
import signal
import sys
import threading

import uvicorn

from engine.router import RouterSpec
from pipeline.config import compose_config
from servers.connections import uvicorn_config
from servers.router import create_router_app


def build(cfg):
    """The app for a composed config: the model, the engine with the configured policy, its worker thread. (torch and
    the model's libraries are imported here: a router starts without them.)"""
    from engine import threads
    from engine.factory import build_engine
    from engine.model.loader import eos_ids, pad_id
    from pipeline.config import kv_spec, load_net, load_source, policy_spec, speculation, speculative_spec
    from servers.app import create_app
    from servers.generate_worker import GenerateWorker
    from servers.worker import EngineWorker

    threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
    load = load_net if cfg.server.name == "engine" else load_source
    model, tokenizer = load(cfg)
    if tokenizer is None:
        raise SystemExit(f"model {cfg.model.name} has no tokenizer; serve a model with one (e.g. model=tiny-chat)")
    srv = cfg.server
    if srv.name != "engine" and speculative_spec(cfg.speculative).method != "none":
        raise SystemExit(f"server={srv.name} does not speculate: speculative decoding runs in server=engine")
    if srv.name == "engine":
        engine = build_engine(model, policy_spec(cfg.policy), int(srv.max_request_tokens), eos_ids=eos_ids(model),
                              seed=int(cfg.seed), kv=kv_spec(cfg.kv), speculation=speculation(cfg, model.vocab_size))
        worker = EngineWorker(engine, int(srv.max_waiting))
    else:
        worker = GenerateWorker(model, eos_ids(model), int(srv.max_request_tokens), int(srv.max_batch),
                                float(srv.max_wait_ms), int(srv.max_waiting), pad_id(tokenizer))
    key = os.environ.get(cfg.server.api_key_env) if cfg.server.api_key_env else None
    return create_app(worker, tokenizer, cfg.model.name, key, int(cfg.server.default_max_tokens),
                      float(srv.max_queue_wait_s), int(srv.max_body_bytes)), worker


def router_app(cfg):
    """The routing server's app for conf/server/router.yaml."""
    srv = cfg.server
    key = os.environ.get(srv.api_key_env) if srv.api_key_env else None
    try:
        spec = RouterSpec(str(srv.policy), int(srv.block_tokens), int(srv.cache_tokens), float(srv.cache_threshold),
                          int(srv.balance_abs), float(srv.balance_rel), int(cfg.seed))
        return create_router_app(list(srv.backends), spec, int(srv.default_max_tokens), str(srv.session_header),
                                 float(srv.health_interval_s), float(srv.health_timeout_s), key,
                                 int(srv.max_body_bytes))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def main(argv: list[str]):
    """HTTP in a thread, the engine loop in the main thread (where torch's thread pool lives); a router: HTTP only."""
    overrides = [f"server.{a}" if a.split("=")[0] in ("port", "host") else a for a in argv]
    cfg = compose_config(overrides)
    srv = cfg.server
    bounds = dict(max_connections=int(srv.max_connections), read_timeout_s=float(srv.read_timeout_s),
                  send_timeout_s=float(srv.send_timeout_s), max_unread_bytes=int(srv.max_unread_bytes))
    if srv.name == "router":
        return uvicorn.Server(uvicorn_config(router_app(cfg), srv.host, int(srv.port), **bounds)).run()
    from pipeline import isa
    isa.apply(cfg.isa)  # before torch does any work: torch, MKL and oneDNN read it once
    app, worker = build(cfg)
    server = uvicorn.Server(uvicorn_config(app, srv.host, int(srv.port), **bounds))
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
