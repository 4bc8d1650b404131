"""What an SGLang-flavoured pod answers on SGLang's own endpoints (pure).

SGLang's router (`sglang-router`, bench/peers.py) asks each worker these besides the
OpenAI-compatible completions: `/server_info` and `/model_info` (or the deprecated
`/get_server_info` and `/get_model_info`) once when it registers the worker, and
`/get_load` every 30 s for its `power_of_two` policy. The documents keep the field names
SGLang's HTTP server uses (`python/sglang/srt/entrypoints/http_server.py`), reduced to
those the simulator has a value for:

- `/get_load`: a list with one entry per data-parallel rank (one here): `dp_rank`,
  `num_reqs` (running + waiting), `num_waiting_reqs`, and `num_tokens`, the KV tokens held
  by running requests plus the waiting requests' whole prompts (the scheduler's `get_load`).
- `/model_info`: `model_path`, `tokenizer_path`, `is_generation`, `model_type`,
  `architectures` (a Llama-3.1-8B-like model).
- `/server_info`: a subset of the server arguments: `model_path`, `tokenizer_path`,
  `served_model_name`, `dp_size`, `tp_size`, `max_running_requests`, `max_total_tokens`,
  `chunked_prefill_size`, `page_size`, `context_length`.
"""

from __future__ import annotations

from typing import Any

from llm_sim.engine import EngineState
from llm_sim.profiles import HardwareProfile

__all__ = ["load_document", "model_info_document", "server_info_document"]


def load_document(state: EngineState, *, profile: HardwareProfile) -> list[dict[str, int]]:
    """SGLang's `/get_load`: one `GetLoadReqOutput` per data-parallel rank (one here)."""
    return [
        {
            "dp_rank": 0,
            "num_reqs": state.num_running + state.num_waiting,
            "num_waiting_reqs": state.num_waiting,
            "num_tokens": state.kv_blocks_used * profile.block_size + state.waiting_prompt_tokens,
        }
    ]


def model_info_document(*, model: str) -> dict[str, Any]:
    """SGLang's `/model_info` for `model`, a Llama-like generation model."""
    return {
        "model_path": model,
        "tokenizer_path": model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }


def server_info_document(*, model: str, profile: HardwareProfile) -> dict[str, Any]:
    """SGLang's `/server_info`: the server arguments the simulator has a value for."""
    return {
        "model_path": model,
        "tokenizer_path": model,
        "served_model_name": model,
        "dp_size": 1,
        "tp_size": 1,
        "max_running_requests": profile.max_num_seqs,
        "max_total_tokens": profile.kv_blocks * profile.block_size,
        "chunked_prefill_size": profile.max_batched_tokens,
        "page_size": profile.block_size,
        "context_length": profile.max_model_len,
    }
