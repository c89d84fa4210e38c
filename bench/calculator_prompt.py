"""What the base model does with the calculator environment's prompt, with and without its
worked exchange (`CalculatorParams.demonstration`), for one- and two-digit sums.

    python bench/calculator_prompt.py [--tasks 32] [--samples 8]

RL can only reinforce what the policy samples. For each setting, on the same held-out tasks
(`eval_task_for`, seed 0), through the environment's own episodes (`reset`/`step`, tool
replies included, up to `max_turns` = 2):
- greedy: accuracy (the `correct` reward is 1) and the share of replies with a tool call,
  as the job's evaluation decodes;
- sampled at temperature 1 (`--samples` per task, as a group): the share of first turns
  with a well-formed tool call, and the share of groups with at least one correct sample
  (a group whose samples all score alike gives GRPO no signal).
Writes `bench/results/calculator-prompt-<date>-<machine>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from machine import machine_fields, result_path  # bench/machine.py
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.files.models import resolve_base_model
from env_svc.envs.calculator import CalculatorEnv
from env_svc.protocol import ChatMessage, EpisodeState
from env_svc.tools import parse_tool_calls

HERE = Path(__file__).parent
BATCH = 64
"""Conversations per `generate` call: bounds memory (KV cache of ~300-token prompts)."""
SETTINGS = {
    "one-digit": {"operations": ["+"], "min_operand": 1, "max_operand": 9},
    "two-digit": {"operations": ["+"], "min_operand": 10, "max_operand": 99},
}


class Generator:
    def __init__(self, model: str) -> None:
        path = resolve_base_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()

    def __call__(self, conversations: list[list[ChatMessage]], sample: bool) -> list[str]:
        replies: list[str] = []
        for start in range(0, len(conversations), BATCH):
            replies += self._generate(conversations[start : start + BATCH], sample)
        return replies

    def _generate(self, conversations: list[list[ChatMessage]], sample: bool) -> list[str]:
        tok = self.tokenizer
        texts = [
            str(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True))  # type: ignore[arg-type]
            for c in conversations
        ]
        encoded = tok(texts, return_tensors="pt", padding=True)
        options: dict[str, Any] = (
            {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
            if sample
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = self.model.generate(
                **encoded, max_new_tokens=48, pad_token_id=tok.pad_token_id, **options
            )
        prompt_len = encoded.input_ids.shape[1]
        return [str(tok.decode(row[prompt_len:], skip_special_tokens=True)) for row in out]


def play(env: CalculatorEnv, generate: Generator, tasks: list[Any], sample: bool) -> dict[str, Any]:
    """Every task's episode to its end, all turns batched; per episode: solved, and whether
    its first turn held a well-formed tool call."""
    started = [env.reset(task) for task in tasks]
    states: list[EpisodeState[Any]] = [state for state, _ in started]
    contexts = [messages for _, messages in started]
    solved: list[bool] = [False] * len(tasks)
    called: list[bool] = [False] * len(tasks)
    active = list(range(len(tasks)))
    for turn in range(env.max_turns):
        if not active:
            break
        replies = generate([contexts[i] for i in active], sample)
        still = []
        for i, text in zip(active, replies, strict=True):
            if turn == 0:
                called[i] = any(
                    c.name == "calculator" and not c.malformed for c in parse_tool_calls(text)
                )
            step = env.step(states[i], text)
            states[i] = step.state
            if step.done:
                assert step.reward is not None
                solved[i] = env.solved(step.reward)
            else:
                contexts[i] = [*contexts[i], {"role": "assistant", "content": text}, *step.messages]
                still.append(i)
        active = still
    for i in active:  # out of turns
        solved[i] = env.solved(env.score(states[i]))
    return {"solved": solved, "called": called}


def measure(
    generate: Generator, params: dict[str, Any], tasks: int, samples: int
) -> dict[str, Any]:
    env = CalculatorEnv({**params, "max_turns": 2})
    drawn = [env.eval_task_for(0, i) for i in range(tasks)]
    started = time.perf_counter()
    greedy = play(env, generate, drawn, sample=False)
    torch.manual_seed(0)
    sampled = play(env, generate, [t for t in drawn for _ in range(samples)], sample=True)
    groups = [sampled["solved"][i * samples : (i + 1) * samples] for i in range(tasks)]
    return {
        "greedy_accuracy": sum(greedy["solved"]) / tasks,
        "greedy_tool_call_share": sum(greedy["called"]) / tasks,
        "sampled_accuracy": sum(sampled["solved"]) / len(sampled["solved"]),
        "sampled_tool_call_share": sum(sampled["called"]) / len(sampled["called"]),
        "groups_with_a_correct_sample": sum(any(g) for g in groups) / tasks,
        "groups_with_signal": sum(any(g) and not all(g) for g in groups) / tasks,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    generate = Generator(args.model)
    runs = []
    for name, params in SETTINGS.items():
        for demonstration in (False, True):
            found = measure(
                generate, {**params, "demonstration": demonstration}, args.tasks, args.samples
            )
            runs.append({"sums": name, "demonstration": demonstration, **found})
            print(json.dumps(runs[-1]), flush=True)
    out = args.out or result_path("calculator-prompt")
    result = {
        "bench": "calculator_prompt",
        "model": args.model,
        "tasks": args.tasks,
        "machine": machine_fields(generation=str(generate.model.dtype).split(".")[-1]),
        "samples": args.samples,
        "max_turns": 2,
        "runs": runs,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
