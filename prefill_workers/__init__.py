"""The prefill pool: workers that run prompts, sample the first token and ship the KV to a decode worker."""
