"""The RL loss on hand-computed cases: advantages, clipping, the IS cap, masks, the shift."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trainer_svc import grpo
from trainer_svc.grpo import (
    group_advantages,
    group_advantages_of,
    masked_token_logprobs,
    policy_loss,
    token_logprobs,
)

CLIP: dict[str, Any] = {"clip_low": 0.2, "clip_high": 0.28, "is_cap": 2.0}
LN = math.log


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


# --- group_advantages -----------------------------------------------------------------


def test_advantages_dr_grpo_subtract_the_group_mean_only() -> None:
    # mean of [1, 0, 0, 1] is 0.5
    advantages_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_normalize=False)
    assert advantages_G.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_advantages_grpo_divide_by_the_population_std() -> None:
    # [1, 0, 0, 1]: deviations ±0.5, population std 0.5 -> ±1 (up to eps)
    advantages_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_normalize=True)
    torch.testing.assert_close(
        advantages_G, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0
    )
    # [2, 0, 1]: mean 1, deviations [1, -1, 0], std sqrt(2/3), 1/sqrt(2/3) = 1.2247449
    advantages_G = group_advantages(torch.tensor([2.0, 0.0, 1.0]), std_normalize=True)
    torch.testing.assert_close(advantages_G, torch.tensor([1.2247449, -1.2247449, 0.0]))


@pytest.mark.parametrize("std_normalize", [False, True])
@pytest.mark.parametrize("reward", [3.0, 1.2, 0.1, 1 / 3])
def test_advantages_of_an_all_equal_group_are_exactly_zero(
    std_normalize: bool, reward: float
) -> None:
    """Also where float32's mean of eight equal rewards is off by an ulp (1.2: the
    calculator's correct answer with its format bonus), which divided by that ulp-sized std
    gave every sample +0.107: a push on a group with nothing to learn."""
    advantages_G = group_advantages(torch.tensor([reward] * 8), std_normalize=std_normalize)
    assert advantages_G.tolist() == [0.0] * 8


# --- policy_loss: the clip ------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "expected_grad", "clipped"),
    [
        # A > 0, r = 1.5 > 1.28: min(1.5, 1.28) = 1.28, the constant side wins -> no gradient
        (1.5, 1.0, -1.28, 0.0, True),
        # A > 0, r = 0.5 < 0.8: min(0.5, 0.8) = 0.5, unclipped -> d(-r)/dlogp = -r = -0.5
        (0.5, 1.0, -0.5, -0.5, False),
        # A < 0, r = 0.5 < 0.8: min(-0.5, -0.8) = -0.8, clipped -> no gradient
        (0.5, -1.0, 0.8, 0.0, True),
        # A < 0, r = 1.5 > 1.28: min(-1.5, -1.28) = -1.5, unclipped -> d(r)/dlogp = r = 1.5
        (1.5, -1.0, 1.5, 1.5, False),
        # inside [0.8, 1.28] both sides agree: loss -r*A = -1.1, gradient -r*A = -1.1
        (1.1, 1.0, -1.1, -1.1, False),
    ],
)
def test_ratio_clip_is_asymmetric_and_stops_the_gradient(
    ratio: float, advantage: float, expected_loss: float, expected_grad: float, clipped: bool
) -> None:
    # prox = mu = 0, so the IS weight is exactly 1 and r = exp(logp) = ratio.
    logprobs_BT = _leaf([[LN(ratio)]])
    loss, metrics = policy_loss(
        logprobs_BT,
        torch.zeros(1, 1),
        torch.tensor([advantage]),
        torch.ones(1, 1),
        proximal_logprobs_BT=torch.zeros(1, 1),
        **CLIP,
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    assert logprobs_BT.grad is not None
    assert logprobs_BT.grad.item() == pytest.approx(expected_grad)
    assert metrics["clip_fraction"] == (1.0 if clipped else 0.0)
    assert metrics["mean_ratio"] == pytest.approx(ratio)


def test_without_a_proximal_policy_the_clip_is_inert_and_mu_is_corrected_by_w() -> None:
    # One step per batch: prox = logp.detach(), so r = 1 in value even though pi/mu = 1.5.
    # w = min(1.5, 2) = 1.5; loss = -1.5 * 1 * A = -1.5; gradient -w * A * r = -1.5.
    logprobs_BT = _leaf([[LN(1.5)]])
    loss, metrics = policy_loss(
        logprobs_BT, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), **CLIP
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.5)
    assert logprobs_BT.grad is not None
    assert logprobs_BT.grad.item() == pytest.approx(-1.5)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["mean_ratio"] == pytest.approx(1.0)
    assert metrics["mean_is_weight"] == pytest.approx(1.5)


# --- policy_loss: the truncated IS weight ---------------------------------------------


def test_is_weight_is_capped_when_the_sampler_under_rated_the_token() -> None:
    # logp = 0, mu = -5: exp(5) = 148.4 -> capped at 2; loss = -2 * A = -2, gradient -2.
    logprobs_BT = _leaf([[0.0]])
    loss, metrics = policy_loss(
        logprobs_BT, torch.tensor([[-5.0]]), torch.tensor([1.0]), torch.ones(1, 1), **CLIP
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert logprobs_BT.grad is not None
    assert logprobs_BT.grad.item() == pytest.approx(-2.0)
    assert metrics["is_capped_fraction"] == 1.0
    assert metrics["mean_is_weight"] == pytest.approx(2.0)


def test_is_weight_is_not_floored_when_the_sampler_over_rated_the_token() -> None:
    # pi = 0.25, mu = 0.5: w = 0.5 (truncation is from above only); loss = -0.5 * A = -0.5.
    loss, metrics = policy_loss(
        _leaf([[LN(0.25)]]),
        torch.tensor([[LN(0.5)]]),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        **CLIP,
    )
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["is_capped_fraction"] == 0.0
    assert metrics["mean_is_weight"] == pytest.approx(0.5)


# --- policy_loss: masks and the token-level mean --------------------------------------


def _masked_case(garbage: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask_BT = torch.tensor([[0, 1, 1, 0]])
    logprobs_BT = _leaf([[garbage, -0.5, -1.0, garbage]])
    behaviour_BT = torch.tensor([[-garbage, -0.7, -0.9, -garbage]])
    loss, _ = policy_loss(logprobs_BT, behaviour_BT, torch.tensor([0.7]), mask_BT, **CLIP)
    loss.backward()
    assert logprobs_BT.grad is not None
    return loss.detach(), logprobs_BT.grad


def test_masked_tokens_change_neither_loss_nor_gradient() -> None:
    reference_loss, reference_grad_BT = _masked_case(0.0)
    for garbage in (1e4, -1e4, math.inf, math.nan):
        loss, grad_BT = _masked_case(garbage)
        assert torch.equal(loss, reference_loss), garbage
        assert torch.equal(grad_BT, reference_grad_BT), garbage
    assert reference_grad_BT[0, 0] == 0.0
    assert reference_grad_BT[0, 3] == 0.0
    assert torch.isfinite(reference_loss)


def test_loss_is_a_token_level_mean_over_sequences_of_different_lengths() -> None:
    # On-policy. Sequence 0: 3 tokens with A = +1; sequence 1: 1 token with A = -1 (+ padding).
    # Token mean: -(3 * 1 + 1 * (-1)) / 4 = -0.5 (a per-sequence mean would give 0).
    # Gradient per token: -A / 4.
    mask_BT = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    logprobs_BT = _leaf([[0.0, -0.1, -0.2, -0.3], [0.0, -0.4, 0.0, 0.0]])
    loss, metrics = policy_loss(
        logprobs_BT, logprobs_BT.detach().clone(), torch.tensor([1.0, -1.0]), mask_BT, **CLIP
    )
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["tokens"] == 4.0
    expected_grad_BT = torch.tensor([[0.0, -0.25, -0.25, -0.25], [0.0, 0.25, 0.0, 0.0]])
    torch.testing.assert_close(logprobs_BT.grad, expected_grad_BT)


def test_a_batch_without_sampled_tokens_gives_zero_not_nan() -> None:
    loss, metrics = policy_loss(
        _leaf([[0.0, -1.0]]), torch.zeros(1, 2), torch.tensor([1.0]), torch.zeros(1, 2), **CLIP
    )
    assert loss.item() == 0.0
    assert metrics["tokens"] == 0.0


# --- policy_loss: on-policy equals the plain policy gradient --------------------------


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_reinforce() -> None:
    # B=2, T=3, V=2. tokens [[0, 1, 0], [0, 0, 1]]; positions 1 and 2 are sampled.
    logits_BTV = torch.tensor(
        [[[0.0, 0.0], [1.0, -1.0], [0.3, 0.2]], [[2.0, 0.0], [0.0, 0.5], [1.0, 1.0]]],
        requires_grad=True,
    )
    token_ids_BT = torch.tensor([[0, 1, 0], [0, 0, 1]])
    mask_BT = torch.tensor([[0, 1, 1], [0, 1, 1]])
    advantages_B = torch.tensor([0.5, -1.5])

    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT)
    loss, metrics = policy_loss(logprobs_BT, logprobs_BT.detach(), advantages_B, mask_BT, **CLIP)
    # -(2 * 0.5 + 2 * (-1.5)) / 4 = 0.5
    assert loss.item() == pytest.approx(0.5)
    assert metrics["mean_is_weight"] == pytest.approx(1.0)
    assert metrics["approx_kl"] == pytest.approx(0.0)
    (grad_ours_BTV,) = torch.autograd.grad(loss, logits_BTV)

    # REINFORCE: -sum_t A * log pi(token_t) / N, gradient through the same logits.
    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT)
    reinforce = -(advantages_B[:, None] * logprobs_BT * mask_BT).sum() / 4
    (grad_reinforce_BTV,) = torch.autograd.grad(reinforce, logits_BTV)
    torch.testing.assert_close(grad_ours_BTV, grad_reinforce_BTV)


# --- policy_loss: every metric and gradient on one constructed batch ------------------


def test_metrics_and_gradients_on_a_constructed_batch() -> None:
    # Position 0 of each row is the prompt (masked, filled with garbage). prox = 0 on the
    # sampled tokens, so r = exp(logp) and w = min(exp(-mu), 2):
    #   (0,1) A=+1  r=1.5  mu=0      w=1           clipped high  l = -1 * 1.28        = -1.28
    #   (0,2) A=+1  r=1    mu=-ln4   w=min(4,2)=2  free          l = -2 * 1           = -2
    #   (1,1) A=-1  r=0.5  mu=ln2    w=0.5         clipped low   l = -0.5 * -0.8      = +0.4
    #   (1,2) A=-1  r=1.5  mu=0      w=1           free          l = -1 * -1.5        = +1.5
    # loss = (-1.28 - 2 + 0.4 + 1.5) / 4 = -0.345
    # grad dl/dlogp = -w * A * r / N on free tokens: (0,2) -2/4 = -0.5; (1,2) +1.5/4 = 0.375.
    # approx_kl with rho = exp(logp - mu): 1.5, 4, 0.25, 1.5; k3 = rho - 1 - ln rho:
    #   sum = 2 (0.5 - ln1.5) + (3 - ln4) + (-0.75 + ln4) = 3.25 - 2 ln1.5 -> / 4
    logprobs_BT = _leaf([[9.0, LN(1.5), 0.0], [-9.0, LN(0.5), LN(1.5)]])
    behaviour_BT = torch.tensor([[-9.0, 0.0, -LN(4)], [9.0, LN(2), 0.0]])
    proximal_BT = torch.tensor([[5.0, 0.0, 0.0], [-5.0, 0.0, 0.0]])
    mask_BT = torch.tensor([[0, 1, 1], [0, 1, 1]])
    loss, metrics = policy_loss(
        logprobs_BT,
        behaviour_BT,
        torch.tensor([1.0, -1.0]),
        mask_BT,
        proximal_logprobs_BT=proximal_BT,
        **CLIP,
    )
    loss.backward()

    assert loss.item() == pytest.approx(-0.345)
    assert metrics == pytest.approx(
        {
            "loss": -0.345,
            "clip_fraction": 2 / 4,
            "is_capped_fraction": 1 / 4,
            "mean_ratio": (1.5 + 1 + 0.5 + 1.5) / 4,
            "mean_is_weight": (1 + 2 + 0.5 + 1) / 4,
            "approx_kl": (3.25 - 2 * LN(1.5)) / 4,
            "entropy": (0 + LN(4) - LN(2) + 0) / 4,  # mean -mu over the sampled tokens
            "tokens": 4.0,
        }
    )
    expected_grad_BT = torch.tensor([[0.0, 0.0, -0.5], [0.0, 0.0, 0.375]])
    torch.testing.assert_close(logprobs_BT.grad, expected_grad_BT)


# --- token_logprobs -------------------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [1, 2, 1024])
def test_token_logprobs_take_token_t_from_the_logits_at_t_minus_1(
    chunk_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpo, "LOGITS_CHUNK_ROWS", chunk_rows)
    # Row 0: logits at t=0 are [0, 0] -> log 1/2 each; at t=1 [ln3, 0] -> probs [3/4, 1/4];
    # the last position predicts past the end and is never read (huge values prove it).
    # Row 1: same logits, other tokens.
    logits_1TV = torch.tensor([[[0.0, 0.0], [LN(3), 0.0], [1e4, -1e4]]])
    logits_BTV = logits_1TV.expand(2, 3, 2)
    token_ids_BT = torch.tensor([[1, 0, 1], [0, 1, 0]])
    logprobs_BT = token_logprobs(logits_BTV, token_ids_BT)
    expected_BT = torch.tensor([[0.0, -LN(2), LN(1 / 4)], [0.0, -LN(2), LN(3 / 4)]])
    torch.testing.assert_close(logprobs_BT, expected_BT)


def test_token_logprobs_are_float32_from_bfloat16_logits() -> None:
    # Uniform logits over V=4: every next token has logprob -ln4, exactly representable.
    logprobs_BT = token_logprobs(
        torch.zeros(1, 3, 4, dtype=torch.bfloat16), torch.tensor([[3, 1, 2]])
    )
    assert logprobs_BT.dtype == torch.float32
    torch.testing.assert_close(logprobs_BT, torch.tensor([[0.0, -LN(4), -LN(4)]]))


def test_token_logprobs_of_a_single_token_is_zero() -> None:
    logprobs_BT = token_logprobs(torch.zeros(2, 1, 5), torch.zeros(2, 1, dtype=torch.long))
    assert logprobs_BT.tolist() == [[0.0], [0.0]]


def test_group_advantages_of_plain_rewards() -> None:
    assert group_advantages_of([0.0, 1.0, 1.0, 0.0], std_normalize=False) == [-0.5, 0.5, 0.5, -0.5]
    normalised = group_advantages_of([0.0, 1.0, 1.0, 0.0], std_normalize=True)
    assert normalised == pytest.approx([-1.0, 1.0, 1.0, -1.0], abs=1e-5)
    assert group_advantages_of([0.3, 0.3], std_normalize=True) == [0.0, 0.0]


def test_masked_token_logprobs_equal_the_full_projection_where_the_loss_looks() -> None:
    torch.manual_seed(0)
    batch, length, hidden, vocab = 3, 7, 8, 11
    hidden_BTH = torch.randn(batch, length, hidden, requires_grad=True)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    token_ids_BT = torch.randint(0, vocab, (batch, length))
    mask_BT = torch.tensor(
        [[0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32
    )
    full_BT = token_logprobs(lm_head(hidden_BTH), token_ids_BT)
    masked_BT = masked_token_logprobs(hidden_BTH, lm_head, token_ids_BT, mask_BT)
    keep_BT = mask_BT.bool().clone()
    keep_BT[:, 0] = False  # position 0 predicts nothing
    assert torch.allclose(masked_BT[keep_BT], full_BT[keep_BT], atol=1e-6)
    assert torch.all(masked_BT[~keep_BT] == 0)

    weights_BT = torch.randn(batch, length) * keep_BT
    (grad_full,) = torch.autograd.grad((full_BT * weights_BT).sum(), hidden_BTH)
    (grad_masked,) = torch.autograd.grad((masked_BT * weights_BT).sum(), hidden_BTH)
    assert torch.allclose(grad_masked, grad_full, atol=1e-6)


def test_entropy_is_the_mean_surprise_of_the_sampled_tokens_under_the_sampler() -> None:
    # -log mu over the masked tokens: (0.5 + 2.0) / 2; garbage outside the mask (a padding
    # position's -inf) reaches neither the metric nor anything else.
    behaviour_BT = torch.tensor([[-0.5, -2.0, -math.inf]])
    _, metrics = policy_loss(
        _leaf([[-0.5, -2.0, 0.0]]),
        behaviour_BT,
        torch.tensor([1.0]),
        torch.tensor([[1.0, 1.0, 0.0]]),
        **CLIP,
    )
    assert metrics["entropy"] == pytest.approx(1.25)
    assert math.isfinite(metrics["loss"])
