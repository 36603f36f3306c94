"""The decoder the runtime executes for every declared family (llmq.models.arch)."""
