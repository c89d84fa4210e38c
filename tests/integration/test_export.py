"""Exporting a trained adapter: a standalone PEFT dir that peft and vLLM load, and its errors."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import yaml

from common.files.models import tiny_model
from common.state.store import RedisStore
from common.wire.messages import EnvSettings, JobSpec, LoraSettings, RLSettings, Trajectory, new_id
from marlaas.export import ExportError, export_adapter
from marlaas.merge import write_merged
from rollout_svc.engine import RolloutEngine
from rollout_svc.engine_settings import EngineSettings
from tests.conftest import with_store
from trainer_svc.policy import MultiAdapterPolicy

pytestmark = pytest.mark.kafka

T = TypeVar("T")
LORA = LoraSettings(rank=4, alpha=8)
TOKENS = [1, 420, 1337, 99, 2024, 7, 300, 451, 12, 880]


def spec(job_id: str, base_model: str = "tiny") -> JobSpec:
    return JobSpec(
        job_id=job_id,
        tenant="acme",
        base_model=base_model,
        env=EnvSettings(name="arithmetic"),
        lora=LORA,
        rl=RLSettings(learning_rate=0.05),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[MultiAdapterPolicy, str, Path]:
    """A job trained 2 steps, its adapters saved where trainer_svc saves them."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    job_id = f"export-{new_id()[:8]}"
    policy = MultiAdapterPolicy(tiny_model())
    policy.add_job(job_id, LORA, spec(job_id).rl, seed=1)
    trajectory = Trajectory(
        episode_id="e",
        job_id=job_id,
        group_id="g",
        sample_index=0,
        group_size=1,
        token_ids=TOKENS,
        loss_mask=[0] * 4 + [1] * 6,
        behaviour_logprobs=[0.0] * 4 + [-9.0] * 6,
        reward=1.0,
    )
    for version in (1, 2):
        policy.train_step(job_id, [trajectory], [1.0])
        policy.save_adapter(job_id, artifacts / "adapters" / job_id / f"v{version}")
    return policy, job_id, artifacts


@pytest.fixture(scope="module")
def published(trained: tuple[MultiAdapterPolicy, str, Path], redis_url_module: str) -> str:
    _, job_id, artifacts = trained

    async def publish(registry: RedisStore) -> None:
        await registry.jobs.register(spec(job_id), status="completed")
        uri = (artifacts / "adapters" / job_id / "v2").resolve().as_uri()
        await registry.adapters.publish(job_id, 2, uri, 2)

    with_store(redis_url_module, publish)
    return job_id


@pytest.fixture(scope="module")
def redis_url_module(local_stack) -> str:  # type: ignore[no-untyped-def]
    return str(local_stack.redis_url)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def test_the_export_loads_with_peft_and_changes_the_output_as_trained(
    trained: tuple[MultiAdapterPolicy, str, Path],
    published: str,
    redis_url_module: str,
    tmp_path: Path,
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy, job_id, _ = trained
    out = tmp_path / "adapter"
    base_path = str(tiny_model())
    exported = with_store(
        redis_url_module,
        lambda r: export_adapter(r, job_id, out, base_model_path=base_path),
    )
    assert (exported.version, exported.tenant, exported.out_dir) == (2, "acme", out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base_path and config["r"] == LORA.rank
    info = json.loads((out / "marlaas_export.json").read_text())
    assert (info["job_id"], info["version"], info["spec"]["tenant"]) == (job_id, 2, "acme")

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)  # as trained
    base_logits = logits(base)
    model = PeftModel.from_pretrained(base, out)
    adapted_logits = logits(model)
    assert (adapted_logits - base_logits).abs().max().item() > 1e-3
    # ...and it is the trained adapter: peft's logprobs equal the trainer's own.
    logprobs_T = torch.log_softmax(adapted_logits, dim=-1)[:-1].gather(
        1, torch.tensor(TOKENS[1:]).unsqueeze(1)
    )[:, 0]
    torch.testing.assert_close(
        logprobs_T, torch.tensor(policy.logprobs(job_id, TOKENS)[1:]), atol=1e-4, rtol=0
    )


def model_card(out: Path) -> tuple[dict[str, object], str]:
    _, front, body = (out / "README.md").read_text().split("---\n", 2)
    return yaml.safe_load(front), body


def test_an_export_of_a_known_base_names_its_public_id(
    trained: tuple[MultiAdapterPolicy, str, Path], redis_url_module: str, tmp_path: Path
) -> None:
    """Usable outside this machine: the config and the card name the Hub's model, not the
    trainer's local copy; a base without a public id is left as it is, and the card says so."""
    _, trained_id, artifacts = trained
    known = f"known-{new_id()[:6]}"

    async def publish(registry: RedisStore) -> None:
        await registry.jobs.register(spec(known, "smollm2-135m-instruct"), status="completed")
        uri = (artifacts / "adapters" / trained_id / "v1").resolve().as_uri()
        await registry.adapters.publish(known, 1, uri, 1)

    with_store(redis_url_module, publish)
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with_store(redis_url_module, lambda r: export_adapter(r, known, tmp_path / "known"))
    config = json.loads((tmp_path / "known" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == hub_id
    front, body = model_card(tmp_path / "known")
    assert front == {
        "base_model": hub_id,
        "library_name": "peft",
        "tags": ["lora", "marlaas", "grpo", "arithmetic"],
    }
    assert f'from_pretrained("{hub_id}")' in body and "de-quantised" in body

    with_store(redis_url_module, lambda r: export_adapter(r, trained_id, tmp_path / "tiny"))
    front, body = model_card(tmp_path / "tiny")
    assert "base_model" not in front and front["library_name"] == "peft"
    assert "without a public id" in body


def test_an_export_names_no_path_or_host_of_the_servers(
    trained: tuple[MultiAdapterPolicy, str, Path],
    published: str,
    redis_url_module: str,
    tmp_path: Path,
) -> None:
    """A tenant receives the export (the API's): none of its files names the artifact store,
    the trainer's copy of the base model or the host. A base without a public id is named as
    the job named it."""
    _, job_id, artifacts = trained
    out = tmp_path / "adapter"
    with_store(redis_url_module, lambda r: export_adapter(r, job_id, out))
    host = re.compile(rf"\b{re.escape(socket.gethostname())}\b")
    weights = (out / "adapter_model.safetensors").read_bytes()
    header = weights[8 : 8 + int.from_bytes(weights[:8], "little")].decode()
    texts = {p.name: p.read_text() for p in out.iterdir() if p.suffix != ".safetensors"}
    for name, text in {**texts, "safetensors header": header}.items():
        for path in (artifacts, artifacts.resolve(), tiny_model(), tiny_model().resolve()):
            assert str(path) not in text, (name, path)
        assert not host.search(text), name
    assert set(texts) == {"adapter_config.json", "marlaas_export.json", "README.md"}
    assert json.loads(texts["adapter_config.json"])["base_model_name_or_path"] == "tiny"


def test_vllm_accepts_the_exported_config(
    published: str, redis_url_module: str, tmp_path: Path
) -> None:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    out = tmp_path / "adapter"
    with_store(redis_url_module, lambda r: export_adapter(r, published, out))
    helper = PEFTHelper.from_local_dir(str(out), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=16))
    assert (helper.r, helper.lora_alpha) == (LORA.rank, LORA.alpha)


def test_an_earlier_version_can_be_exported(
    trained: tuple[MultiAdapterPolicy, str, Path],
    published: str,
    redis_url_module: str,
    tmp_path: Path,
) -> None:
    _, job_id, artifacts = trained
    out = tmp_path / "v1"
    exported = with_store(redis_url_module, lambda r: export_adapter(r, job_id, out, version=1))
    assert exported.version == 1
    source = artifacts / "adapters" / job_id / "v1" / "adapter_model.safetensors"
    assert (out / "adapter_model.safetensors").read_bytes() == source.read_bytes()


def test_export_errors_say_what_is_wrong(
    published: str, redis_url_module: str, tmp_path: Path
) -> None:
    def export(job_id: str, out: Path, **kwargs: object) -> str:
        with pytest.raises(ExportError) as caught:
            with_store(redis_url_module, lambda r: export_adapter(r, job_id, out, **kwargs))  # type: ignore[arg-type]
        return str(caught.value)

    assert export("no-such-job", tmp_path / "a") == "unknown job 'no-such-job'"
    untrained = f"untrained-{new_id()[:6]}"
    with_store(redis_url_module, lambda r: r.jobs.register(spec(untrained), status="running"))
    assert "has no trained adapter yet (running)" in export(untrained, tmp_path / "b")
    assert "versions 1..2, not 3" in export(published, tmp_path / "c", version=3)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert "exists and is not an empty directory" in export(published, occupied)
    assert (occupied / "notes.txt").read_text() == "mine"
    elsewhere = f"elsewhere-{new_id()[:6]}"

    async def publish_missing(registry: RedisStore) -> None:
        await registry.jobs.register(spec(elsewhere), status="running")
        await registry.adapters.publish(elsewhere, 1, "file:///nonexistent/adapters/x/v1", 1)

    with_store(redis_url_module, publish_missing)
    missing = export(elsewhere, tmp_path / "d")
    assert "run export where the artifact store" in missing and "nonexistent" not in missing
    assert not list(tmp_path.glob(".*export-*"))  # no staging dir left behind

    # A tenant reads these (the API's 409): they name the file, not where it lies.
    broken = f"broken-{new_id()[:6]}"
    adapter_dir = tmp_path / "artifacts" / "adapters" / broken / "v1"
    adapter_dir.mkdir(parents=True)
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"not safetensors")

    async def publish_broken(registry: RedisStore) -> None:
        await registry.jobs.register(spec(broken), status="running")
        await registry.adapters.publish(broken, 1, adapter_dir.as_uri(), 1)

    with_store(redis_url_module, publish_broken)
    assert export(broken, tmp_path / "e").startswith("adapter_config.json: unreadable (")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    unreadable = export(broken, tmp_path / "f")
    assert unreadable.startswith("adapter_model.safetensors: not a readable safetensors file")
    assert str(tmp_path) not in unreadable


HELD_OUT = {
    0: {"eval_accuracy": 0.25, "eval_accuracy_stderr": 0.108, "eval_episodes": 16.0},
    2: {"eval_accuracy": 0.5, "eval_accuracy_stderr": 0.125, "eval_episodes": 16.0},
}


@pytest.fixture(scope="module")
def merged(published: str, redis_url_module: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job's v2 exported with its held-out results, then merged into the tiny base in
    float32."""
    root = tmp_path_factory.mktemp("merged")
    adapter = root / "adapter"
    with_store(redis_url_module, lambda r: export_adapter(r, published, adapter, held_out=HELD_OUT))
    written = write_merged(adapter, tiny_model(), root / "model", dtype="float32")
    assert written.dtype == "float32"
    return written.out_dir


def test_the_merged_export_is_the_base_with_the_adapter_applied(merged: Path) -> None:
    """transformers loads it with no PEFT, and its logits are the base's with the adapter
    applied (float32); the adapter, its info and a card with the held-out results beside."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    weights = (merged / "model.safetensors").read_bytes()
    header = json.loads(weights[8 : 8 + int.from_bytes(weights[:8], "little")])
    assert not [name for name in header if "lora" in name]
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}
    assert not (merged / "adapter_config.json").exists()  # else transformers reads a PEFT dir
    model = AutoModelForCausalLM.from_pretrained(merged)
    base = AutoModelForCausalLM.from_pretrained(tiny_model(), dtype=torch.float32)
    base_logits = logits(base)
    adapted = logits(PeftModel.from_pretrained(base, merged / "adapter"))
    assert (adapted - base_logits).abs().max().item() > 1e-3  # the adapter changes the output
    assert (logits(model) - adapted).abs().max().item() < 1e-3

    info = json.loads((merged / "adapter" / "marlaas_export.json").read_text())
    assert info["held_out"]["2"]["eval_accuracy"] == 0.5 and info["version"] == 2
    front, body = model_card(merged)
    assert front["library_name"] == "transformers"
    assert front["tags"] == ["marlaas", "grpo", "merged-lora", "arithmetic"]
    assert "| base | 0.250 | 0.108 | 16 |" in body and "| v2 (this export) | 0.500 |" in body
    _, adapter_body = model_card(merged / "adapter")
    assert "| v2 (this export) | 0.500 | 0.125 | 16 |" in adapter_body


async def test_vllm_loads_and_samples_the_merged_export(merged: Path) -> None:
    """vLLM's CPU engine serves the merged directory as a base model (no LoRA), and scores
    what it sampled as transformers scores it on the merged weights."""
    from tests.integration.test_rollout_engine import reference_logprobs, request

    engine = RolloutEngine(EngineSettings(merged, enable_lora=False))
    await engine.start()
    try:
        result = await engine.generate(request(max_new_tokens=8))
    finally:
        await engine.stop()
    assert len(result.completion_token_ids) == 8
    expected = reference_logprobs(merged, result.context_token_ids, result.completion_token_ids)
    assert result.logprobs == pytest.approx(expected, abs=0.05)


def test_a_merge_into_the_wrong_base_or_dtype_says_so(merged: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(merged / "adapter", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps(config | {"target_modules": ["no_such_proj"]})
    )
    with pytest.raises(ExportError, match="does not fit the base model"):
        write_merged(adapter, tiny_model(), tmp_path / "wrong")
    with pytest.raises(ExportError, match="dtype must be one of"):
        write_merged(merged / "adapter", tiny_model(), tmp_path / "int4", dtype="int4")
    with pytest.raises(ExportError, match="not an empty directory"):
        write_merged(merged / "adapter", tiny_model(), merged)
    assert not list(tmp_path.glob(".*")) and not (tmp_path / "wrong").exists()
    auto = write_merged(merged / "adapter", tiny_model(), tmp_path / "auto")
    assert auto.dtype == "bfloat16"  # the tiny base's own
