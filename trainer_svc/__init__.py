"""trainer_svc: one base model, one LoRA adapter and optimizer per job, GRPO steps."""
