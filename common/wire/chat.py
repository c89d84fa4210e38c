"""The rollout replicas' chat endpoint (rollout_svc/chat_api.py) as its server and its callers
(the tenant API, `marlaas sample`) share it: the credential's purpose and the limits of one
request."""

from __future__ import annotations

CHAT = "chat"
"""The purpose of the endpoint's credential (`SharedSettings.internal_token`), which only
holders of the bus key can derive."""
MAX_TOKENS = 1024
"""The most tokens one answer may have."""
MAX_PROMPT_CHARS = 32_768
"""A request's messages, all together: tokenised on the replica's event loop."""
JOB_HEADER = "X-Marlaas-Job"
"""A request made for a job's episode (a judged reward's): the replica queues it as the job's
tenant's, beside the rollouts, instead of in the endpoint's own few slots."""
