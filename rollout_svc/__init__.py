"""rollout_svc: the vLLM engine sampling every job's requests with that job's LoRA adapter."""
