"""Rollout engines: one contract (`api`), three backends (`torch`, `vllm`, `sglang`), the
parts they share (`requests`, `length_control`) and `factory.build_engine`; what a weight
update must hold is `scalerl.weights.check`.
Importing this package or `api` loads no torch."""
