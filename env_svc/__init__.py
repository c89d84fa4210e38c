"""env_svc: environments and rewards, episode and group orchestration, flow control."""
