"""The multi-adapter trainer on a tiny random Llama: isolation between jobs, exact batching
arithmetic, adapter export that peft and vLLM load, and bit-identical checkpoint resume."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from common.files.artifacts import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from common.files.models import tiny_model
from common.wire.messages import LoraSettings, RLSettings, Trajectory
from trainer_svc.forward import pad as _pad
from trainer_svc.grpo import token_logprobs
from trainer_svc.optimizers import NonFiniteGradientError
from trainer_svc.packing import PackRow, plan_packs
from trainer_svc.policy import MultiAdapterPolicy

LORA = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
RL = RLSettings(learning_rate=1e-2)


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return tiny_model()


def _trajectory(token_ids: list[int], loss_mask: list[int], episode: str = "e") -> Trajectory:
    # On-policy enough: behaviour logprobs are irrelevant to the gradient direction here, and
    # a constant keeps the IS weight well under the cap.
    behaviour = [-10.0 if m else 0.0 for m in loss_mask]
    return Trajectory(
        episode_id=episode,
        job_id="job",
        group_id="g",
        sample_index=0,
        group_size=1,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour,
        reward=1.0,
    )


def _batch() -> list[Trajectory]:
    """Four sequences of different lengths: a 4-token prompt, then sampled tokens."""
    generator = torch.Generator().manual_seed(0)
    batch = []
    for index, length in enumerate([12, 7, 10, 5]):
        ids = torch.randint(100, 5000, (length,), generator=generator).tolist()
        batch.append(_trajectory(ids, [0] * 4 + [1] * (length - 4), episode=f"e{index}"))
    return batch


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        try:
            torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0)
        except AssertionError as exc:
            raise AssertionError(f"{key}: {exc}") from None


def _base_weights(policy: MultiAdapterPolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy._base.named_parameters() if "lora_" not in n}


def _masked_logprob(policy: MultiAdapterPolicy, job: str | None, trajectory: Trajectory) -> float:
    logprobs_T = policy.logprobs(job, trajectory.token_ids)
    return sum(lp for lp, m in zip(logprobs_T, trajectory.loss_mask, strict=True) if m)


def test_a_new_adapter_is_the_identity(base_dir: Path) -> None:
    policy = MultiAdapterPolicy(base_dir)
    base_T = policy.logprobs(None, _batch()[0].token_ids)
    policy.add_job("a", LORA, RL, seed=1)
    assert policy.jobs == ["a"]
    assert policy.logprobs("a", _batch()[0].token_ids) == base_T


def test_a_step_moves_only_its_own_job(base_dir: Path) -> None:
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL)
    policy.add_job("b.tenant/2", LoraSettings(rank=2, alpha=4), RL)  # id peft would reject
    base_before = _base_weights(policy)
    trajectory = _batch()[0]
    before_a = _masked_logprob(policy, "a", trajectory)
    b_before = policy.adapter_state("b.tenant/2")

    for _ in range(3):
        metrics = policy.train_step("a", [trajectory], [1.0])
    assert metrics["tokens"] == 8 and metrics["grad_norm"] > 0

    assert _masked_logprob(policy, "a", trajectory) > before_a + 0.1
    _assert_same_state(policy.adapter_state("b.tenant/2"), b_before, atol=0)
    # b never saw a gradient and its adapter still equals the base model.
    assert _masked_logprob(policy, "b.tenant/2", trajectory) == _masked_logprob(
        policy, None, trajectory
    )

    a_after = policy.adapter_state("a")
    policy.train_step("b.tenant/2", [trajectory], [-1.0])
    _assert_same_state(policy.adapter_state("a"), a_after, atol=0)
    _assert_same_state(_base_weights(policy), base_before, atol=0)

    policy.remove_job("a")
    assert policy.jobs == ["b.tenant/2"]


def test_threads_are_asked_between_layers_forward_and_backward(base_dir: Path) -> None:
    """trainer_svc/compute.py may lend a core mid-pass: the policy asks before each decoder
    layer's forward and backward, the step says its time-weighted threads, and the update is
    the one without asking."""
    asked: list[bool] = []

    def adjust() -> int:
        asked.append(torch.is_grad_enabled())  # off while autograd runs the backward
        return 1 + 2 * (len(asked) % 2)  # 1 and 3 threads, in turn

    plain = MultiAdapterPolicy(base_dir)
    asking = MultiAdapterPolicy(base_dir, adjust_threads=adjust)
    for policy in (plain, asking):
        policy.add_job("a", LORA, RL, seed=3)
    trajectory = _batch()[0]
    assert "threads" not in plain.train_step("a", [trajectory], [1.0])
    metrics = asking.train_step("a", [trajectory], [1.0])

    layers = len(asking._base.get_decoder().layers)
    assert asked.count(True) >= layers and asked.count(False) >= layers
    # Time-weighted: between the two counts (torch's own count runs until the first ask).
    assert 1.0 < metrics["threads"] < max(3.0, torch.get_num_threads())
    _assert_same_state(asking.adapter_state("a"), plain.adapter_state("a"), atol=0)


def test_zero_advantages_change_nothing(base_dir: Path) -> None:
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL)
    before = policy.adapter_state("a")
    # A fresh optimizer has no momentum, so a zero gradient must be a zero update.
    metrics = policy.train_step("a", _batch(), [0.0] * 4)
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    _assert_same_state(policy.adapter_state("a"), before, atol=0)


def test_rows_without_advantage_are_skipped_with_the_same_update(base_dir: Path) -> None:
    """Rows whose advantage is 0 stay out of the passes; the adapter ends where computing them
    takes it. A step where every row is 0 has no signal and leaves the adapter where it was,
    computed or not (Adam's momentum would otherwise still move it), and the next step with
    a signal goes on from the same optimizer state."""
    policies = {}
    for skip in (True, False):
        policy = MultiAdapterPolicy(base_dir, skip_zero_advantages=skip)
        policy.add_job("a", LORA, RL, seed=5)
        policies[skip] = policy
    steps = [[1.0, 0.0, -0.5, 0.0], [0.0, 0.75, 0.0, -1.0], [0.0] * 4, [0.5, 0.0, 0.0, -0.5]]
    for advantages in steps:
        before = policies[True].adapter_state("a")
        skipped = policies[True].train_step("a", _batch(), advantages)
        computed = policies[False].train_step("a", _batch(), advantages)
        assert skipped["loss"] == pytest.approx(computed["loss"], rel=1e-5, abs=1e-7)
        assert skipped["tokens"] == computed["tokens"]
        assert skipped["zero_advantage_share"] == advantages.count(0.0) / 4
        _assert_same_state(
            policies[True].adapter_state("a"), policies[False].adapter_state("a"), atol=1e-6
        )
        moved = any(
            not torch.equal(before[name], tensor)
            for name, tensor in policies[True].adapter_state("a").items()
        )
        assert moved == any(advantages), advantages


def test_entropy_is_over_every_row_and_no_kl_is_made_up_for_skipped_ones(base_dir: Path) -> None:
    """The sampler's entropy comes from the logprobs every row carries, computed or not; the
    KL, ratio and clip metrics compare the trained policy with the sampler, so a step whose
    rows all had zero advantage (none computed) reports none of them rather than 0."""
    batch = [
        msgspec.structs.replace(
            row, behaviour_logprobs=[-(i + 1.0) if m else 0.0 for m in row.loss_mask]
        )
        for i, row in enumerate(_batch())
    ]
    tokens = [sum(row.loss_mask[1:]) for row in batch]
    entropy = sum(n * (i + 1) for i, n in enumerate(tokens)) / sum(tokens)
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL)
    some = policy.train_step("a", batch, [1.0, 0.0, 0.0, -1.0])
    assert some["entropy"] == pytest.approx(entropy)
    assert {"approx_kl", "clip_fraction", "mean_ratio"} <= set(some)
    none = policy.train_step("a", batch, [0.0] * 4)
    assert none["entropy"] == pytest.approx(entropy)
    assert not {"approx_kl", "clip_fraction", "mean_ratio", "is_capped_fraction"} & set(none)
    assert none["loss"] == 0.0 and none["zero_advantage_share"] == 1.0


def test_fresh_kl_is_zero_for_the_trainers_own_samples_and_not_for_another_adapters(
    base_dir: Path,
) -> None:
    """`fresh_kl` compares the sampler with the trainer on the rows sampled with the version
    the trainer holds: rows scored by that very adapter give 0; rows that claim the version
    but came from another adapter's weights (an engine serving the wrong adapter) do not.
    Stale rows and steps without `versions` give none."""
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL, seed=1)
    policy.add_job("other", LORA, RL, seed=2)
    policy.train_step("other", _batch(), [1.0, -1.0, 1.0, -1.0])  # other's weights now differ

    def sampled_by(job: str, version: int) -> list[Trajectory]:
        return [
            msgspec.structs.replace(
                row,
                behaviour_logprobs=[
                    lp if m else 0.0
                    for lp, m in zip(
                        policy.logprobs(job, row.token_ids), row.loss_mask, strict=True
                    )
                ],
                adapter_versions=[version],
            )
            for row in _batch()
        ]

    advantages = [1.0, -1.0, 0.5, 0.0]
    own = sampled_by("a", 0)
    assert policy.train_steps({"a": (own, advantages)}, {"a": 0})["a"]["fresh_kl"] == (
        pytest.approx(0.0, abs=1e-6)
    )
    held = 1  # "a" has stepped once: rows of version 0 are stale now
    assert "fresh_kl" not in policy.train_steps({"a": (own, advantages)}, {"a": held})["a"]
    assert "fresh_kl" not in policy.train_step("a", own, advantages)
    wrong = sampled_by("other", 3)
    metrics = policy.train_steps({"a": (wrong, advantages)}, {"a": 3})["a"]
    assert metrics["fresh_kl"] > 1e-3
    assert metrics["fresh_kl"] == pytest.approx(metrics["approx_kl"])  # every row is fresh


def test_micro_batches_give_the_same_update_as_one_batch(base_dir: Path) -> None:
    whole = MultiAdapterPolicy(base_dir, micro_batch_tokens=4096)
    split = MultiAdapterPolicy(base_dir, micro_batch_tokens=14)  # [12], [10], [7, 5]
    rows = [PackRow("g", t.token_ids, t.loss_mask) for t in _batch()]
    assert [pack.rows for pack in plan_packs(rows, 14)] == [[0], [2], [1, 3]]
    advantages = [1.0, -0.5, 0.25, -1.0]
    for policy in (whole, split):
        policy.add_job("a", LORA, RL, seed=3)
    for _ in range(2):  # the second step also moves LoRA A (its gradient is 0 while B is 0)
        metrics_whole = whole.train_step("a", _batch(), advantages)
        metrics_split = split.train_step("a", _batch(), advantages)
    _assert_same_state(whole.adapter_state("a"), split.adapter_state("a"), atol=1e-5)
    for key in ("loss", "mean_ratio", "mean_is_weight", "approx_kl", "tokens"):
        assert metrics_whole[key] == pytest.approx(metrics_split[key], rel=1e-5, abs=1e-7)
    assert metrics_whole["tokens"] == 8 + 3 + 6 + 1


def test_masked_and_padded_tokens_do_not_change_the_update(base_dir: Path) -> None:
    plain = MultiAdapterPolicy(base_dir)
    padded = MultiAdapterPolicy(base_dir)
    for policy in (plain, padded):
        policy.add_job("a", LORA, RL, seed=3)
    batch = _batch()
    longer = batch[1]
    # Tool-output-like tail: masked tokens after the sampled ones, with junk behaviour values.
    extended = _trajectory([*longer.token_ids, 7, 8, 9, 10, 11], longer.loss_mask + [0] * 5)
    extended.behaviour_logprobs[-5:] = [float("-inf")] * 5
    plain.train_step("a", batch, [1.0, -1.0, 0.5, 0.0])
    padded.train_step("a", [batch[0], extended, batch[2], batch[3]], [1.0, -1.0, 0.5, 0.0])
    _assert_same_state(plain.adapter_state("a"), padded.adapter_state("a"), atol=1e-5)


def test_saved_adapter_loads_in_peft_with_the_same_logits(base_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("other", LORA, RL)
    policy.add_job("a", LORA, RL)
    policy.train_step("a", _batch(), [1.0, -1.0, 0.5, -0.5])
    policy.train_step("a", _batch(), [1.0, -1.0, 0.5, -0.5])

    out_dir = policy.save_adapter("a", tmp_path / "adapters" / "a" / "v1")
    assert sorted(p.name for p in out_dir.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    config = json.loads((out_dir / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(base_dir)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 4
    assert config["use_dora"] is False and config["bias"] == "none"
    # Saving again replaces the directory atomically and leaves no temporary dirs behind.
    policy.save_adapter("a", out_dir)
    assert [p.name for p in out_dir.parent.iterdir()] == ["v1"]

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out_dir).eval()
    token_ids = _batch()[0].token_ids
    with torch.no_grad():
        logits_BTV = loaded(input_ids=torch.tensor([token_ids])).logits
    loaded_T = token_logprobs(logits_BTV, torch.tensor([token_ids]))[0]
    torch.testing.assert_close(loaded_T, torch.tensor(policy.logprobs("a", token_ids)))
    assert policy.logprobs("a", token_ids) != policy.logprobs(None, token_ids)


def test_saved_adapter_passes_vllms_lora_loader(base_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL)
    policy.train_step("a", _batch(), [1.0, -1.0, 0.5, -0.5])
    out_dir = policy.save_adapter("a", tmp_path / "v1")
    helper = PEFTHelper.from_local_dir(str(out_dir), max_position_embeddings=2048)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    lora_model = LoRAModel.from_local_checkpoint(
        str(out_dir),
        expected_lora_modules={"q_proj", "k_proj", "v_proj", "o_proj"},
        peft_helper=helper,
        lora_model_id=1,
        device="cpu",
        dtype=torch.float32,
    )
    assert len(lora_model.loras) == 2 * 2  # two layers x (q_proj, v_proj)


def test_checkpoint_resume_continues_bit_identically(base_dir: Path, tmp_path: Path) -> None:
    batch = _batch()
    first, second = [1.0, -1.0, 0.5, -0.5], [-0.5, 1.0, -1.0, 0.5]
    straight = MultiAdapterPolicy(base_dir)
    straight.add_job("a", LORA, RL)
    straight.train_step("a", batch, first)
    straight.train_step("a", batch, second)

    before = MultiAdapterPolicy(base_dir)
    before.add_job("a", LORA, RL)
    before.train_step("a", batch, first)
    ckpt_dir = before.save_checkpoint("a", tmp_path / "ckpt", step=1, version=1)

    resumed = MultiAdapterPolicy(base_dir)
    resumed.add_job("unrelated", LORA, RL)
    resumed.add_job("a", LORA, RL, seed=99)  # a different init, overwritten by the load
    assert resumed.load_checkpoint("a", ckpt_dir) == (1, 1)
    _assert_same_state(resumed.adapter_state("a"), before.adapter_state("a"), atol=0)
    resumed.train_step("a", batch, second)
    _assert_same_state(resumed.adapter_state("a"), straight.adapter_state("a"), atol=1e-6)

    mismatched = MultiAdapterPolicy(base_dir)
    mismatched.add_job("a", LoraSettings(rank=2), RL)
    with pytest.raises(ValueError, match="checkpoint has LoRA"):
        mismatched.load_checkpoint("a", ckpt_dir)


def test_bf16_logprobs_and_gradients_match_float32_within_tolerance(base_dir: Path) -> None:
    """bf16 autocast vs float32 on the same batch. Tolerance stated: logprobs within 0.05
    (bf16 keeps 8 mantissa bits); the LoRA gradient's direction within cosine 0.99 and its
    norm within 10% (float32 masters and optimizer state keep the update itself exact)."""
    token_ids_BT, attention_BT, mask_BT, _ = _pad(_batch())
    weights_BT = torch.linspace(-1.0, 1.0, mask_BT.numel()).reshape(mask_BT.shape) * mask_BT
    logprobs, grads = {}, {}
    for dtype in ("float32", "bfloat16"):
        policy = MultiAdapterPolicy(base_dir, compute_dtype=dtype)  # type: ignore[arg-type]
        policy.add_job("job", LORA, RL, seed=3)
        policy.train_step("job", _batch(), [1.0, -0.5, 0.25, -1.0])  # LoRA B off zero
        job = policy._activate("job")
        logprobs_BT = policy.loss_forward.loss_logprobs(
            token_ids_BT, attention_BT, mask_BT, [job.adapter_name] * len(token_ids_BT)
        )
        params = job.params
        logprobs[dtype] = logprobs_BT.detach()
        grads[dtype] = torch.cat(
            [g.flatten() for g in torch.autograd.grad((logprobs_BT * weights_BT).sum(), params)]
        )
    assert logprobs["bfloat16"].dtype == torch.float32
    assert (logprobs["bfloat16"] - logprobs["float32"]).abs().max() <= 0.05
    cosine = torch.nn.functional.cosine_similarity(grads["bfloat16"], grads["float32"], dim=0)
    assert cosine >= 0.99
    assert grads["bfloat16"].norm() == pytest.approx(float(grads["float32"].norm()), rel=0.1)


def _job_batch(seed: int) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for index in range(4):
        length = int(torch.randint(6, 14, (1,), generator=generator))
        ids = torch.randint(100, 5000, (length,), generator=generator).tolist()
        batch.append(_trajectory(ids, [0] * 4 + [1] * (length - 4), episode=f"s{seed}e{index}"))
    return batch


@pytest.mark.parametrize("micro_batch_tokens", [2048, 24])
def test_a_batched_step_gives_each_job_its_solo_update(
    base_dir: Path, micro_batch_tokens: int
) -> None:
    """Three jobs (different ranks, targets and learning rates) trained in shared forward and
    backward passes end where each ends trained alone: losses within 1e-5, adapter weights
    within 5e-5 (each Adam step moves a weight by about lr = 1e-2, and Adam's normalisation
    turns float32 summation-order rounding of a near-zero gradient into up to ~1e-5 of that).
    With a small token budget the micro-batches mix jobs and split each job's batch."""
    jobs = {
        "a": (LORA, RL),
        "b": (LoraSettings(rank=2, alpha=4), RLSettings(learning_rate=5e-3)),
        "c": (LORA, RLSettings(learning_rate=2e-2, clip_high=0.1)),
    }
    advantages = [1.0, -0.5, 0.25, -1.0]
    policies = {}
    for mode in ("solo", "batched"):
        policy = MultiAdapterPolicy(base_dir, micro_batch_tokens=micro_batch_tokens)
        for seed, (job_id, (lora, rl)) in enumerate(jobs.items()):
            policy.add_job(job_id, lora, rl, seed=seed)
        policies[mode] = policy
    for step in range(2):  # the first step moves LoRA B off zero, so A gets gradients too
        batches = {
            job_id: (_job_batch(10 * step + seed), advantages) for seed, job_id in enumerate(jobs)
        }
        solo = {
            job_id: policies["solo"].train_step(job_id, *batch) for job_id, batch in batches.items()
        }
        batched = policies["batched"].train_steps(batches)
        for job_id in jobs:
            assert batched[job_id]["jobs_in_step"] == 3 and solo[job_id]["jobs_in_step"] == 1
            assert batched[job_id]["tokens"] == solo[job_id]["tokens"]
            assert batched[job_id]["loss"] == pytest.approx(solo[job_id]["loss"], abs=1e-5)
            assert batched[job_id]["grad_norm"] == pytest.approx(
                solo[job_id]["grad_norm"], rel=1e-4
            )
    for job_id in jobs:
        _assert_same_state(
            policies["batched"].adapter_state(job_id), policies["solo"].adapter_state(job_id), 5e-5
        )
        assert any(t.abs().sum() > 0 for t in policies["batched"].adapter_state(job_id).values())


def test_the_device_setting_resolves_or_says_why_not() -> None:
    from trainer_svc.policy import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device("cuda:0")


def _group_batch(seed: int, group: str, prompt_len: int = 9) -> list[Trajectory]:
    """A group: four samples of one prompt, completions of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(100, 5000, (prompt_len,), generator=generator).tolist()
    batch = []
    for index, length in enumerate([6, 3, 5, 2]):
        completion = torch.randint(100, 5000, (length,), generator=generator).tolist()
        trajectory = _trajectory(
            prompt + completion, [0] * prompt_len + [1] * length, episode=f"{group}{index}"
        )
        batch.append(msgspec.structs.replace(trajectory, group_id=group))
    return batch


@pytest.mark.parametrize("micro_batch_tokens", [4096, 30])
def test_a_shared_prompt_run_once_gives_the_plain_batch_update(
    base_dir: Path, micro_batch_tokens: int
) -> None:
    """Each group's prompt through the model once (its keys and values copied to the
    samples) vs once per sample, float32: same losses within 1e-5, and the two steps'
    adapter updates within 0.1% of the update's norm (Adam divides each gradient by its own
    scale, so one weight whose gradient is near zero can differ by ~1% from rounding alone).
    With a 30-token budget a group's samples are split over packs."""
    trajectories = _group_batch(0, "g0") + _group_batch(1, "g1", prompt_len=11)
    advantages = [1.0, -0.5, 0.25, -1.0, 0.5, -1.0, 1.0, -0.5]
    rows = [PackRow(t.group_id, t.token_ids, t.loss_mask) for t in trajectories]
    packs = plan_packs(rows, micro_batch_tokens)
    assert {pack.prefix_len for pack in packs} == {8, 10}  # up to the token before the first loss
    assert sorted(i for pack in packs for i in pack.rows) == list(range(8))
    assert all(pack.cost([len(r.token_ids) for r in rows]) <= micro_batch_tokens for pack in packs)
    policies = {}
    for share in (True, False):
        policy = MultiAdapterPolicy(
            base_dir, micro_batch_tokens=micro_batch_tokens, share_prefixes=share
        )
        policy.add_job("a", LORA, RL, seed=3)
        policies[share] = policy
    before = policies[True].adapter_state("a")
    for _ in range(2):
        shared = policies[True].train_step("a", trajectories, advantages)
        plain = policies[False].train_step("a", trajectories, advantages)
        assert shared["loss"] == pytest.approx(plain["loss"], abs=1e-5)
        assert shared["tokens"] == plain["tokens"] == 2 * (6 + 3 + 5 + 2)
    moved = {
        share: torch.cat([(p.adapter_state("a")[k] - before[k]).flatten() for k in before])
        for share, p in policies.items()
    }
    assert moved[False].norm() > 0
    assert (moved[True] - moved[False]).norm() <= 1e-3 * moved[False].norm()


@pytest.mark.parametrize("share_prefixes", [True, False])
def test_rows_in_batches_by_length_give_the_one_batch_update(
    base_dir: Path, share_prefixes: bool
) -> None:
    """A pack's suffixes in a batch per length (no overhead) vs all padded to the longest:
    same loss within 1e-5, adapter updates within 0.1% of the update's norm, and the padding
    the metrics report is gone."""
    trajectories = _group_batch(0, "g0") + _group_batch(1, "g1", prompt_len=11)
    advantages = [1.0, -0.5, 0.25, -1.0, 0.5, -1.0, 1.0, -0.5]
    policies = {}
    for overhead in (0, 10**9):
        policy = MultiAdapterPolicy(
            base_dir, share_prefixes=share_prefixes, sub_batch_overhead=overhead
        )
        policy.add_job("a", LORA, RL, seed=3)
        policies[overhead] = policy
    before = policies[0].adapter_state("a")
    for _ in range(2):
        split = policies[0].train_step("a", trajectories, advantages)
        whole = policies[10**9].train_step("a", trajectories, advantages)
        assert split["loss"] == pytest.approx(whole["loss"], abs=1e-5)
        assert split["padding_share"] == 0.0 < whole["padding_share"]
        assert split["positions"] < whole["positions"]
    moved = {
        overhead: torch.cat([(p.adapter_state("a")[k] - before[k]).flatten() for k in before])
        for overhead, p in policies.items()
    }
    assert moved[0].norm() > 0
    assert (moved[0] - moved[10**9]).norm() <= 1e-3 * moved[10**9].norm()


def test_a_non_finite_gradient_takes_no_step_for_any_job(base_dir: Path) -> None:
    """One job's advantage is inf (or its adapter diverged): no optimizer steps, every
    adapter stays as it was and finite, and the other job trains alone afterwards (issue 24)."""
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL)
    policy.add_job("b", LORA, RL)
    policy.train_step("a", [_batch()[0]], [1.0])  # a has moved off the identity
    before = {job: policy.adapter_state(job) for job in ("a", "b")}
    batch = _batch()
    with pytest.raises(
        NonFiniteGradientError, match=r"job\(s\) b: the step was not taken"
    ) as caught:
        policy.train_steps({"a": (batch[:2], [1.0, -1.0]), "b": (batch[2:], [float("inf"), 1.0])})
    assert caught.value.job_ids == ["b"]
    for job, state in before.items():
        _assert_same_state(policy.adapter_state(job), state, atol=0)
        assert all(torch.isfinite(t).all() for t in policy.adapter_state(job).values())
    metrics = policy.train_steps({"a": (batch[:2], [1.0, -1.0])})["a"]
    assert metrics["grad_norm"] > 0


def test_a_step_takes_its_versions_learning_rate_from_the_schedule(base_dir: Path) -> None:
    rl = msgspec.structs.replace(RL, max_steps=12, lr_schedule="linear")
    trajectory = _batch()[0]
    deltas = {}
    for version in (0, 9):  # steps 1 and 10 of 12: the peak, then 3/12 of it
        policy = MultiAdapterPolicy(base_dir)
        policy.add_job("a", LORA, rl, seed=1)
        before = policy.adapter_state("a")
        metrics = policy.train_steps({"a": ([trajectory], [1.0])}, versions={"a": version})["a"]
        assert metrics["learning_rate"] == pytest.approx(rl.learning_rate * (12 - version) / 12)
        after = policy.adapter_state("a")
        deltas[version] = sum(float((after[k] - before[k]).norm() ** 2) for k in after) ** 0.5
    # Adam's first update is the rate times ~sign(gradient): it scales with the rate.
    assert deltas[9] / deltas[0] == pytest.approx(0.25, rel=0.05)
    # Without versions (a job trained by hand) the rate stays `rl.learning_rate`.
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, rl, seed=1)
    assert policy.train_step("a", [trajectory], [1.0])["learning_rate"] == rl.learning_rate


def test_logits_at_all_positions_train_the_same_update_as_at_the_loss_positions(
    base_dir: Path,
) -> None:
    """`loss_logits="all_positions"` (the plain causal-LM path benches compare against)
    computes the same logprobs, so one step moves the adapter the same way; it takes no
    shared prefixes."""
    states = {}
    for where in ("loss_positions", "all_positions"):
        policy = MultiAdapterPolicy(base_dir, share_prefixes=False, loss_logits=where)  # type: ignore[arg-type]
        policy.add_job("job", LORA, RL, seed=3)
        policy.train_step("job", _batch(), [1.0, -0.5, 0.25, -1.0])
        states[where] = policy.adapter_state("job")
    _assert_same_state(states["all_positions"], states["loss_positions"], atol=1e-5)
    with pytest.raises(ValueError, match="share_prefixes=False"):
        MultiAdapterPolicy(base_dir, loss_logits="all_positions")
