"""Multi-seed studies: the paper's arms run over seeds (runner.py), one metric per finding
(metrics.py), paired statistics and verdicts (stats.py), study.csv / study.md (findings.py);
driver.py ties them together for `megatron-sdpo study` and `compare`."""
