"""`megatron-sdpo eval MODEL [PRESET]`: one eval row for any HF model directory."""
from __future__ import annotations

from pathlib import Path

from megatron_sdpo import builders
from megatron_sdpo.chat import set_template_kwargs
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.engine_logs import route_engine_logs
from megatron_sdpo.evaluation import evaluate_config, load_eval_sets
from megatron_sdpo.run_dir import RunDir


def run_eval(cfg: RunConfig, out: str | Path, *, verbose: bool = False) -> dict[str, float]:
    """Evaluate `cfg.model.path` on every domain/split of `cfg`; writes eval_matrix.csv in `out`
    (engine logs in `out`/logs/engine.log unless verbose)."""
    model_path = builders.resolve_model_path(cfg)  # a corrupt model fails before anything is written
    run_dir = RunDir(out)
    run_dir.prepare(resume=False)
    route_engine_logs(run_dir.root, verbose=verbose)
    tokenizer = set_template_kwargs(builders.load_tokenizer(model_path), cfg.model.chat_template_kwargs)
    eval_sets = load_eval_sets(cfg)
    engine = builders.make_rollout(cfg, model_path, tokenizer, str(run_dir.root / ".rollout"))
    accs, _ = evaluate_config(engine, tokenizer, eval_sets, cfg, seed=cfg.seed)
    run_dir.write_eval_matrix([(Path(model_path).name or "model", accs)])
    for key, acc in accs.items():
        print(f"{key:24s} {acc:.3f}")
    return accs
