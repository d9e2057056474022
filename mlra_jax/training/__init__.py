"""Training: `loop` (resume, step, log, evaluate, checkpoint), `state` (the sharded state and the jitted
step), `step` (the pure train step), `resume_check` (may this run continue?), `run_lock` (one writer)."""
