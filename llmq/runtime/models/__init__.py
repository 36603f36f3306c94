"""Model definitions the runtime executes (the Llama family: Llama, Mistral, Qwen2, SmolLM2)."""
