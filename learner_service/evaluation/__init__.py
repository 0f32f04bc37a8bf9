"""The learner's held-out evaluations: the scorer on the workers (`evaluate`), the job
that runs beside training (`schedule`), the budget and cadence (`budget`), and the
`EvalReporter` that writes eval.jsonl and the curve points (`reporter`)."""
