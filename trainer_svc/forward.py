"""The trainer's forward pass: logprobs at the loss positions, with the gradient, each row
through its own job's adapter; a group's shared prompt computed once (trainer_svc/packing.py);
rows in batches of similar length, each padded only to its own longest."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from common.runtime.hardware import ComputeDtype
from common.wire.messages import Trajectory
from trainer_svc.grpo import masked_token_logprobs, token_logprobs
from trainer_svc.packing import length_batches

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

LossLogits = Literal["loss_positions", "all_positions"]
"""Where the forward pass computes logits: "loss_positions" projects only the hidden states
the loss reads through the vocabulary; "all_positions" computes logits at every position and
picks the logprobs from them (the plain causal-LM path: more memory and FLOPs, one adapter
per pass, no shared prompts; the reference benches compare against)."""


@dataclass
class SharedPrefix:
    """Prefixes a pack computes once per group (trainer_svc/packing.py)."""

    token_ids_GP: torch.Tensor
    adapter_names_G: list[str]
    group_of_row_B: torch.Tensor
    """Each row's index into the prefixes."""


class LossForward:
    """Trainer logprobs of a padded batch, on the policy's PEFT model."""

    def __init__(
        self,
        peft: Callable[[], PeftModel],
        device: torch.device,
        compute_dtype: ComputeDtype,
        sub_batch_overhead: int,
        loss_logits: LossLogits = "loss_positions",
    ) -> None:
        """`peft`: the policy's model (created with its first job). The rest as
        `MultiAdapterPolicy` takes them."""
        self.peft = peft
        self.device = device
        self.compute_dtype = compute_dtype
        self.sub_batch_overhead = sub_batch_overhead
        self.loss_logits = loss_logits

    def loss_logprobs(
        self,
        token_ids_BT: torch.Tensor,
        attention_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        adapter_names_B: Sequence[str],
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Trainer logprobs at the loss positions (0 elsewhere), with the gradient; row b
        goes through adapter `adapter_names_B[b]`. With `prefix`, the rows continue the
        prefix rows' tokens (computed once per group): the tensors hold only what follows
        them."""
        import torch

        with torch.autocast(
            self.device.type,
            dtype=getattr(torch, self.compute_dtype),
            enabled=self.compute_dtype != "float32",
        ):
            if self.loss_logits == "all_positions":
                if prefix is not None:
                    raise ValueError("logits at all positions take no shared prefix")
                with self.routing(adapter_names_B):
                    logits_BTV = self.peft()(
                        input_ids=token_ids_BT, attention_mask=attention_BT, use_cache=False
                    ).logits
                return token_logprobs(logits_BTV, token_ids_BT)
            return self._by_length(token_ids_BT, attention_BT, mask_BT, adapter_names_B, prefix)

    def _by_length(
        self,
        token_ids_BT: torch.Tensor,
        attention_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        adapter_names_B: Sequence[str],
        prefix: SharedPrefix | None,
    ) -> torch.Tensor:
        """The rows in batches of similar length (`length_batches`), logits only at the
        loss positions."""
        import torch

        # The causal LM with the LoRA layers injected (typed loosely in peft's stubs).
        model: Any = self.peft().get_base_model()
        decoder = model.get_decoder()
        lengths_B = attention_BT.sum(dim=1).tolist()
        prefix_kv = self._prefix_kv(decoder, prefix)
        logprobs_B: list[torch.Tensor] = [mask_BT.new_zeros(0)] * len(lengths_B)
        for batch in length_batches(lengths_B, self.sub_batch_overhead):
            rows_b = torch.tensor(batch, device=self.device)
            length = max(lengths_B[b] for b in batch)
            attention_bT = attention_BT[rows_b, :length]
            cache = None
            if prefix is not None:
                cache, attention_bT = _continuing(prefix, prefix_kv, rows_b, attention_bT)
            with self.routing([adapter_names_B[b] for b in batch]):
                hidden_bTH = decoder(
                    input_ids=token_ids_BT[rows_b, :length],
                    attention_mask=attention_bT,
                    past_key_values=cache,
                    use_cache=cache is not None,
                ).last_hidden_state
            logprobs_bT = masked_token_logprobs(
                hidden_bTH,
                model.get_output_embeddings(),
                token_ids_BT[rows_b, :length],
                mask_BT[rows_b, :length],
            )
            padding = token_ids_BT.shape[1] - length
            for row, logprobs_T in zip(batch, logprobs_bT, strict=True):
                logprobs_B[row] = torch.nn.functional.pad(logprobs_T, (0, padding))
        return torch.stack(logprobs_B)

    def _prefix_kv(
        self, decoder: Any, prefix: SharedPrefix | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the shared prefixes (none without them)."""
        if prefix is None:
            return []
        with self.routing(prefix.adapter_names_G):
            past = decoder(input_ids=prefix.token_ids_GP, use_cache=True).past_key_values
        return [(layer.keys, layer.values) for layer in past.layers]

    def routing(self, adapter_names_B: Sequence[str]) -> contextlib.AbstractContextManager[Any]:
        """Route row b of the next forward pass through adapter `adapter_names_B[b]`."""
        peft = self.peft()
        if set(adapter_names_B) == {peft.active_adapter}:
            return contextlib.nullcontext()
        # peft's mixed-adapter batch: each LoRA layer adds each row's own adapter. The hooks
        # are what PeftModel.forward installs for `adapter_names`; we call the decoder
        # directly (logits only at the loss positions), so install them here. (set_adapter
        # instead would freeze the other jobs of this step.)
        hooks: Any = peft._enable_peft_forward_hooks
        return hooks(adapter_names=list(adapter_names_B))  # type: ignore[no-any-return]


def _continuing(
    prefix: SharedPrefix,
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor]],
    rows_b: torch.Tensor,
    attention_bT: torch.Tensor,
) -> tuple[Any, torch.Tensor]:
    """The cache and attention mask of rows that continue their groups' prefixes. Each row
    attends to its group's keys and values; the gradient of every row's loss flows back
    through these copies into the one prefix pass."""
    import torch
    from transformers import DynamicCache

    groups_b = prefix.group_of_row_B[rows_b]
    cache = DynamicCache(
        ddp_cache_data=[
            (keys.index_select(0, groups_b), values.index_select(0, groups_b))
            for keys, values in prefix_kv
        ]
    )
    attention_bT = torch.cat(
        [attention_bT.new_ones((len(rows_b), prefix.token_ids_GP.shape[1])), attention_bT],
        dim=1,
    )
    return cache, attention_bT


def pad(
    batch: Sequence[Trajectory], start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence from position `start` on; padding is out of the
    attention and the loss."""
    import torch

    length = max(len(t.token_ids) for t in batch) - start
    token_ids_BT = torch.zeros((len(batch), length), dtype=torch.long)
    attention_BT = torch.zeros((len(batch), length), dtype=torch.long)
    mask_BT = torch.zeros((len(batch), length), dtype=torch.float32)
    behaviour_BT = torch.zeros((len(batch), length), dtype=torch.float32)
    for row, trajectory in enumerate(batch):
        n = len(trajectory.token_ids)
        if len(trajectory.loss_mask) != n or len(trajectory.behaviour_logprobs) != n:
            raise ValueError(f"episode {trajectory.episode_id}: misaligned mask or logprobs")
        token_ids_BT[row, : n - start] = torch.tensor(trajectory.token_ids[start:])
        attention_BT[row, : n - start] = 1
        mask_BT[row, : n - start] = torch.tensor(trajectory.loss_mask[start:], dtype=torch.float32)
        behaviour_BT[row, : n - start] = torch.tensor(trajectory.behaviour_logprobs[start:])
    # No logprob at position 0, nor at a suffix's first position (its logits are the
    # prefix's, and packing never cuts before a loss position).
    mask_BT[:, 0] = 0.0
    return token_ids_BT, attention_BT, mask_BT, behaviour_BT
