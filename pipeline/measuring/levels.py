"""The engine at each precision level of one model, built one way for every stage that sets levels side by side
(check_precision, engine_speed)."""
from engine.factory import load_source
from pipeline.config import build_net, compose_config, model_spec, precision_spec

NOT_HERE = (ValueError, RuntimeError, AssertionError)  # a level this model or machine cannot run (no GGUF, no CUDA)


def level_nets(cfg, names, models: dict | None = None) -> tuple[dict, dict[str, str], object]:
    """(name -> (the engine's FlatModel at that level, the Hugging Face model it is compared against, the level's
    conf/precision entry), name -> why a level is not measured here, the tokenizer) for each level in `names`
    composed for cfg's model. models: (dtype, device) -> (Hugging Face model, tokenizer), each loaded once (give a
    model already loaded to share it); a level's net is built from the model of its dtype, its reference is the
    model of its reference_dtype. A level that cannot run is said and skipped, not measured."""
    models = {} if models is None else models
    levels, skipped = {}, {}
    for name in names:
        try:
            level = compose_config([f"model={cfg.model.name}", f"precision={name}"])
            pc, spec = level.precision, precision_spec(level.precision)
            for reference in (False, True):
                dtype = spec.reference_dtype or spec.dtype if reference else spec.dtype
                if (dtype, pc.device) not in models:
                    models[dtype, pc.device] = load_source(model_spec(cfg.model), spec, reference)
            net = build_net(models[pc.dtype, pc.device][0], level)
        except NOT_HERE as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name}: not measured: {skipped[name]}", flush=True)
            continue
        levels[name] = (net, models[pc.get("reference_dtype", pc.dtype), pc.device][0], pc)
    tokenizer = next((tok for _, tok in models.values() if tok is not None), None)
    return levels, skipped, tokenizer
