"""Quality of an artifact as llmq serves it: lm-eval over the bundled runtime, offline tasks, KLD, baseline
comparison with confidence intervals, gates and eval-report artifacts. Entry point: `evaluate.run_eval`."""
