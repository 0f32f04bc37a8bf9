"""Rollout engines: one contract (`api`), three backends (`torch`, `vllm`, `sglang`), the
parts they share (`requests`, `length_control`, `weight_check`) and `factory.build_engine`.
Importing this package or `api` loads no torch."""
