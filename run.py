"""Entry point: `python run.py [group=choice ...] [key=value ...]` (Hydra; see conf/config.yaml).

    python run.py                                    # default job: smollm2-135m, keydiff, 2k, B=128, NIAH
    python run.py policy=keydiff budget=8k
    python run.py -m policy=keydiff,snapkv,tova budget=2k,4k block_size=64,128,256
    python run.py experiment=table1                  # a whole paper table (conf/experiment/)
"""

from __future__ import annotations

import json
import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from keydiff.runner import run

log = logging.getLogger("keydiff")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    summary = run(cfg, HydraConfig.get().runtime.output_dir)
    log.info("metrics: %s", json.dumps(summary["metrics"], default=str)[:2000])
    log.info("statistics: %s", json.dumps(summary["statistics"], default=str))
    log.info("results: %s", summary["run_dir"])
    primary = summary["metrics"].get("score") if isinstance(summary["metrics"], dict) else None
    return primary if isinstance(primary, (int, float)) else None


if __name__ == "__main__":
    main()
