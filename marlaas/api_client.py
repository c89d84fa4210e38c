"""`TenantClient`: a tenant's way in, the tenant API (api_svc/) with an API key.

A tenant's program holds no Kafka or Redis credentials and uses it directly; the CLI
`marlaas` talks to the API when `MARLAAS_API_URL` and `MARLAAS_API_KEY` are set (or
`--api-url` / `--api-key`), and straight to Kafka and Redis with the operator's credentials
otherwise. The methods mirror `Client`'s, so the CLI's commands read the same either
way; an API error is raised as `ApiError` with the API's own message.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import tempfile
from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.state.usage import TenantUsage, Usage
from common.wire.messages import Event, JobAction, JobSpec


class ApiClientSettings(BaseSettings):
    """Where a tenant's CLI finds the API, and its key."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_", extra="ignore")

    api_url: str = ""
    """The tenant API's base URL, e.g. `http://marlaas.example:8080` (empty: operator mode,
    straight to Kafka and Redis)."""
    api_key: str = ""
    """The tenant's API key (`mlk_...`, from `marlaas tenants add`)."""


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TenantClient:
    """`async with TenantClient(url, key) as client: await client.submit([...])`."""

    def __init__(self, url: str, key: str, *, timeout_s: float = 30.0) -> None:
        if not key:
            raise ValueError("MARLAAS_API_URL is set but MARLAAS_API_KEY is not: no API key")
        # `marlaas up` shows the API's address with its /v1, as a browser or curl uses it.
        self.url = url.rstrip("/").removesuffix("/v1")
        self._http = httpx.AsyncClient(
            base_url=f"{self.url}/v1",
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(timeout_s, read=300.0),
        )

    async def __aenter__(self) -> TenantClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._http.aclose()

    # --- jobs -------------------------------------------------------------------------

    async def tenant(self) -> dict[str, Any]:
        return dict(await self._json("GET", "/tenant"))

    async def submit(self, specs: Sequence[JobSpec]) -> None:
        """POST each spec; stops at the first refused (the API says why)."""
        for spec in specs:
            body = msgspec.to_builtins(spec)
            await self._json("POST", "/jobs", json=body)

    async def jobs(self) -> list[dict[str, Any]]:
        return list(await self._json("GET", "/jobs"))

    async def job(self, job_id: str) -> dict[str, Any]:
        return dict(await self._json("GET", f"/jobs/{job_id}"))

    async def usage(self) -> TenantUsage:
        """The key's tenant's usage, in total and per job (`GET /v1/usage`)."""
        answer = await self._json("GET", "/usage")
        jobs = {job.pop("job_id"): Usage(**job) for job in answer["jobs"]}
        return TenantUsage(answer["tenant"], Usage(**answer["total"]), jobs)

    async def command(self, job_id: str, action: JobAction, *, wait_s: float = 30.0) -> str:
        answer = await self._json("POST", f"/jobs/{job_id}/{action}")
        return str(answer["status"])

    async def events(self, job_id: str) -> list[Event]:
        raw = await self._request("GET", f"/jobs/{job_id}/events")
        return msgspec.json.decode(raw.content, type=list[Event])

    async def episodes(self, job_id: str, *, limit: int = 5) -> list[dict[str, Any]]:
        """The job's latest finished episodes as text, newest first (marlaas/episodes.py
        `EpisodeSample`'s fields)."""
        return list(await self._json("GET", f"/jobs/{job_id}/episodes", params={"limit": limit}))

    async def follow(self, job_id: str) -> AsyncIterator[Event]:
        async with self._http.stream(
            "GET", f"/jobs/{job_id}/events", params={"follow": "true"}
        ) as response:
            if response.is_error:
                await response.aread()
                raise _error(response)
            async for line in response.aiter_lines():
                if line.strip():
                    yield msgspec.json.decode(line, type=Event)

    async def export(
        self, job_id: str, out_dir: Path, *, version: int | None = None, best: bool = False
    ) -> int:
        """Unpack the job's adapter into `out_dir` (new or empty); returns its version."""
        if _not_empty(out_dir):
            raise ValueError(f"{out_dir} is not empty")
        params = {} if version is None else {"version": str(version)}
        if best:
            params["best"] = "true"
        response = await self._request("GET", f"/jobs/{job_id}/export", params=params)
        _unpack_into(response.content, out_dir)
        return int(response.headers["X-Adapter-Version"])

    async def report(self, job_ids: Collection[str], out_dir: Path) -> Path:
        params = [("job", job_id) for job_id in job_ids]
        response = await self._request("GET", "/report", params=params)
        _unpack_into(response.content, out_dir)
        return out_dir / "index.html"

    async def sample(
        self, job_id: str, prompt: str, *, version: int | None, max_tokens: int, temperature: float
    ) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "version": version,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        return dict(await self._json("POST", f"/jobs/{job_id}/sample", json=body))

    # --- helpers ----------------------------------------------------------------------

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self._request(method, path, **kwargs)).json()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"tenant API at {self.url} unreachable: {exc}") from None
        if response.is_error:
            raise _error(response)
        return response


def _error(response: httpx.Response) -> ApiError:
    try:
        body = json.loads(response.content)
        message = body.get("error") or body.get("detail") or response.reason_phrase
    except ValueError:
        message = response.text or response.reason_phrase
    if isinstance(message, list):  # FastAPI's validation errors
        message = "; ".join(str(item.get("msg", item)) for item in message)
    return ApiError(response.status_code, f"{message} (HTTP {response.status_code})")


def _not_empty(directory: Path) -> bool:
    return directory.exists() and any(directory.iterdir())


def _unpack_into(archive: bytes, out_dir: Path) -> None:
    """Unpack a .tar.gz whose one top-level directory becomes `out_dir`, whole or not at all."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}-") as scratch:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            _extract_data(tar, scratch)
        (top,) = Path(scratch).iterdir()
        if out_dir.exists():
            out_dir.rmdir()  # empty: checked by the caller
        shutil.move(top, out_dir)


def _extract_data(tar: tarfile.TarFile, into: str) -> None:
    """Extract only plain files and directories inside `into` (tarfile's "data" filter; on
    Python before 3.11.4, such as Debian bookworm's 3.11.2, which lacks it, the same check by
    hand): a hostile archive writes nowhere else and makes no links or devices."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, filter="data")
        return
    root = Path(into).resolve()
    for member in tar.getmembers():
        target = (root / member.name).resolve()
        if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
            raise ValueError(f"the export archive holds {member.name!r}: not a plain file in it")
    tar.extractall(into)  # every member checked above
