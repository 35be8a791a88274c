"""`megatron-sdpo eval MODEL [PRESET]`: one eval row for any HF model directory."""
from __future__ import annotations

from pathlib import Path

from megatron_sdpo import builders
from megatron_sdpo.config.schema import RunConfig
from megatron_sdpo.data.sources import load_source
from megatron_sdpo.evaluation import evaluate
from megatron_sdpo.run_dir import RunDir


def run_eval(cfg: RunConfig, out: str | Path) -> dict[str, float]:
    """Evaluate `cfg.model.path` on every domain/split of `cfg`; writes eval_matrix.csv in `out`."""
    run_dir = RunDir(out)
    run_dir.prepare(resume=False)
    model_path = builders.resolve_model_path(cfg)
    tokenizer = builders.load_tokenizer(model_path)
    eval_sets = {
        f"{d}/{split}": load_source(src, d, split, seed=cfg.seed + 1)
        for d, dcfg in cfg.domains.items()
        for split, src in dcfg.eval.items()
    }
    engine = builders.make_rollout(cfg, model_path, tokenizer, str(run_dir.root / ".rollout"))
    e = cfg.eval
    accs, _ = evaluate(
        engine,
        tokenizer,
        eval_sets,
        greedy=e.greedy,
        avg_k=e.avg_k,
        max_new_tokens=e.max_new_tokens,
        temperature=cfg.rollout.temperature,
        batch_size=e.batch_size,
        seed=cfg.seed,
        batched_code=cfg.rewards.batched_code,
    )
    run_dir.write_eval_matrix([(Path(model_path).name or "model", accs)])
    for key, acc in accs.items():
        print(f"{key:24s} {acc:.3f}")
    return accs
