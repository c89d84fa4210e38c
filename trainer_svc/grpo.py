"""The RL loss: group-relative advantages and the asynchronous clipped policy objective.

This module owns the loss (docs/architecture.md, "Conventions": one owner per contract).
Logprob tensors follow `Trajectory`'s alignment: position t holds the logprob of token t (so
position 0, which has no predecessor, is 0 and always masked out).

Objective (decoupled PPO, AReaL; Fu et al. 2025), per masked token t of sequence b, with
  logp     = trainer logprob under the parameters being optimised (carries the gradient),
  prox     = proximal logprob: the trainer's policy at the start of the optimizer step, detached
             (defaults to logp.detach(), which is exact for one optimizer step per batch),
  mu       = behaviour logprob recorded by the sampler (possibly several versions stale),
  A        = advantage of sequence b:

  r   = exp(logp - prox)                                   PPO ratio, carries the gradient
  w   = min(exp(prox - mu), is_cap)                        truncated IS weight, detached
  l_t = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
  L   = sum_{b,t masked} l_t / (number of masked tokens)   token-level mean (DAPO)

Why split the ratio in two: mu is the policy that sampled, which under staleness S is an older
adapter (and a different kernel stack: vLLM vs. the trainer). The trust region belongs around
the recent policy, not the stale one, so the clip uses r = pi/prox; the gap between prox and
mu is corrected by w, capped so a rare token the sampler under-rated cannot blow up the
update (truncated IS, Yao et al. 2025). Each factor covers its own gap, so nothing is counted
twice: w * r = pi/mu in value. With one optimizer step per batch r == 1 in value, the clip is
inert and the gradient is the truncated-IS policy gradient -w * A * grad(logp) / N; the clip
acts once a caller takes several steps on one batch and passes `proximal_logprobs_BT`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LOGITS_CHUNK_ROWS = 1024
"""Positions per chunk in `token_logprobs`: bounds the float32 copy of the logits."""


def group_advantages(
    rewards_G: torch.Tensor, *, std_normalize: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Reward minus the group mean; divided by the group std too when `std_normalize` (GRPO).

    Off is Dr. GRPO: dividing by the std up-weights groups that are nearly solved or nearly
    failed, a bias Liu et al. (2025) remove. A group with all-equal rewards carries no signal
    and gets zero advantages either way (eps keeps 0/0 from becoming NaN).
    """
    rewards_G = rewards_G.to(torch.float32)
    if rewards_G.numel() == 0 or bool((rewards_G == rewards_G[0]).all()):
        # Exactly zero: float32's mean of equal values can be an ulp off (8 x 1.2), and the
        # std of that ulp would scale it to ~0.1.
        return torch.zeros_like(rewards_G)
    advantages_G = rewards_G - rewards_G.mean()
    if std_normalize:
        # Population std: the group is the whole sample, not an estimate of a larger one.
        advantages_G = advantages_G / (rewards_G.std(correction=0) + eps)
    return advantages_G


def group_advantages_of(rewards_G: Sequence[float], *, std_normalize: bool) -> list[float]:
    """`group_advantages` of one group's rewards as plain floats, one per trajectory."""
    return group_advantages(torch.tensor(list(rewards_G)), std_normalize=std_normalize).tolist()


def policy_loss(
    logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_cap: float,
    proximal_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled, clipped, truncated-IS objective of the module docstring.

    Returns the scalar loss and metrics over the masked tokens:
    - clip_fraction: tokens whose clipped branch won the min (zero gradient there),
    - is_capped_fraction: tokens whose IS weight exp(prox - mu) exceeded `is_cap`,
    - mean_ratio (r = pi/prox), mean_is_weight (w, after the cap),
    - approx_kl: k3 estimate of KL(mu || pi), mean of (rho - 1) - log rho with rho = pi/mu;
      unbiased because the tokens were sampled from mu, and never negative,
    - entropy: mean -log mu(token), the sampling policy's per-token entropy estimated from
      its own samples (unbiased, from the logprobs the rollouts carry: no vocabulary pass);
      a collapse towards 0 is a policy that stopped exploring,
    - tokens: the number of masked tokens.
    """
    mask_BT = loss_mask_BT.bool()
    # Zero the log-differences outside the mask before exp, so garbage there (padding,
    # prompt positions, inf) can reach neither the loss nor the gradient.
    zero_BT = torch.zeros_like(logprobs_BT)
    prox_BT = logprobs_BT.detach() if proximal_logprobs_BT is None else proximal_logprobs_BT
    log_ratio_BT = torch.where(mask_BT, logprobs_BT - prox_BT.detach(), zero_BT)
    log_is_BT = torch.where(mask_BT, prox_BT - behaviour_logprobs_BT, zero_BT).detach()

    ratio_BT = torch.exp(log_ratio_BT)
    is_weight_BT = torch.exp(log_is_BT).clamp(max=is_cap)
    advantages_BT = advantages_B.to(logprobs_BT.dtype)[:, None].expand_as(logprobs_BT)
    unclipped_BT = ratio_BT * advantages_BT
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_BT
    token_loss_BT = -is_weight_BT * torch.minimum(unclipped_BT, clipped_BT)

    tokens = mask_BT.sum()
    # clamp: a batch with no sampled tokens gives loss 0, not NaN.
    denominator = tokens.clamp(min=1).to(logprobs_BT.dtype)
    loss = torch.where(mask_BT, token_loss_BT, zero_BT).sum() / denominator

    metrics = _loss_metrics(
        loss,
        ratio_BT,
        log_is_BT,
        advantages_BT,
        logprobs_BT,
        behaviour_logprobs_BT,
        mask_BT,
        clip_low=clip_low,
        clip_high=clip_high,
        is_cap=is_cap,
    )
    return loss, metrics


@torch.no_grad()
def _loss_metrics(
    loss: torch.Tensor,
    ratio_BT: torch.Tensor,
    log_is_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    is_cap: float,
) -> dict[str, float]:
    """`policy_loss`'s metrics: means over the masked tokens (see its docstring)."""
    tokens = mask_BT.sum()
    denominator = tokens.clamp(min=1).to(logprobs_BT.dtype)
    zero_BT = torch.zeros_like(logprobs_BT)
    clip_active_BT = ((advantages_BT > 0) & (ratio_BT > 1.0 + clip_high)) | (
        (advantages_BT < 0) & (ratio_BT < 1.0 - clip_low)
    )
    k3_BT = k3_kl(logprobs_BT.detach(), behaviour_logprobs_BT, mask_BT)
    is_weight_BT = torch.exp(log_is_BT).clamp(max=is_cap)

    def masked_mean(values_BT: torch.Tensor) -> float:
        return float((values_BT.to(torch.float32) * mask_BT).sum() / denominator)

    return {
        "loss": float(loss.detach()),
        "clip_fraction": masked_mean(clip_active_BT),
        "is_capped_fraction": masked_mean(torch.exp(log_is_BT) > is_cap),
        "mean_ratio": masked_mean(ratio_BT),
        "mean_is_weight": masked_mean(is_weight_BT),
        "approx_kl": masked_mean(k3_BT),
        "entropy": masked_mean(torch.where(mask_BT, -behaviour_logprobs_BT, zero_BT)),
        "tokens": float(tokens),
    }


def k3_kl(
    logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi) for tokens sampled from mu: (rho - 1) - log rho
    with rho = pi / mu, never negative; 0 outside the mask (where garbage may sit)."""
    log_rho_BT = torch.where(mask_BT.bool(), logprobs_BT - behaviour_logprobs_BT, 0.0)
    return torch.expm1(log_rho_BT) - log_rho_BT


def token_logprobs(logits_BTV: torch.Tensor, token_ids_BT: torch.Tensor) -> torch.Tensor:
    """Float32 logprob of each token given the tokens before it; position 0 gets 0.

    Logits at position t-1 predict token t, hence the shift. Works in chunks of positions so
    no full B x T x V float32 log-softmax is materialised (autograd still keeps each float32 chunk
    for the backward pass).
    """
    batch, length, vocab = logits_BTV.shape
    logits_NV = logits_BTV[:, :-1].reshape(-1, vocab)
    targets_N = token_ids_BT[:, 1:].reshape(-1)
    if length < 2:
        return logits_BTV.new_zeros((batch, length), dtype=torch.float32)
    shifted_BT = _picked_logprobs(logits_NV, targets_N, lambda x: x).reshape(batch, length - 1)
    first_B1 = shifted_BT.new_zeros((batch, 1))
    return torch.cat([first_B1, shifted_BT], dim=1)


def masked_token_logprobs(
    hidden_BTH: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    token_ids_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
) -> torch.Tensor:
    """`token_logprobs` at the loss positions only, from the last hidden states.

    The vocabulary projection is the model's largest matmul per position (SmolLM2: 49k x 576,
    ~21% of its FLOPs); prompt and tool-output positions never enter the loss, so they skip it.
    Equals `token_logprobs(lm_head(hidden_BTH), token_ids_BT)` where the mask (from position 1
    on) is set, and 0 elsewhere, in value and in gradient.
    """
    batch, length, _ = hidden_BTH.shape
    logprobs_BT = hidden_BTH.new_zeros((batch, length), dtype=torch.float32)
    rows_B, positions_N = loss_mask_BT[:, 1:].nonzero(as_tuple=True)
    if rows_B.numel() == 0:
        return logprobs_BT
    positions_N = positions_N + 1  # the token predicted; its logits come from position t-1
    targets_N = token_ids_BT[rows_B, positions_N]
    hidden_NH = hidden_BTH[rows_B, positions_N - 1]
    return logprobs_BT.index_put(
        (rows_B, positions_N), _picked_logprobs(hidden_NH, targets_N, lm_head)
    )


def _picked_logprobs(
    rows_N: torch.Tensor,
    targets_N: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Float32 log-softmax of `to_logits(row)` at each row's target, LOGITS_CHUNK_ROWS rows at
    a time, so no N x V float32 block is materialised at once (autograd keeps each chunk)."""
    chunks_N = []
    for start in range(0, rows_N.shape[0], LOGITS_CHUNK_ROWS):
        logits_CV = to_logits(rows_N[start : start + LOGITS_CHUNK_ROWS]).to(torch.float32)
        targets_C = targets_N[start : start + LOGITS_CHUNK_ROWS]
        picked_C = logits_CV.gather(-1, targets_C[:, None]).squeeze(-1)
        chunks_N.append(picked_C - torch.logsumexp(logits_CV, dim=-1))
    return torch.cat(chunks_N)
