"""The OpenAI-style APIs a pool can serve (`pools[].api`), and the paths of each.

The gateway's data path is closed: a request reaches a model server only on a path of an
API its pool lists, by POST, and only once the gateway has read the body's `model` (or
the model header) and found the pool. Each API here carries `model` in a JSON body: that
is what lets the gateway route it. What vLLM serves but is left out, and why:

- `/v1/audio/transcriptions` and `/v1/audio/translations`: a multipart body, whose
  `model` the gateway cannot read (its JSON reader sees JSON only);
- `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: no model in the request,
  and a stored response lives on the one pod that made it;
- `/invocations` (SageMaker), `/v1/messages` (Anthropic's API), `/generate` and the admin
  paths (`/metrics`, `/health`, `/load`, `/v1/load_lora_adapter`, ...): not OpenAI's
  surface, or not for clients.

The engine-specific APIs are vLLM's (its api_router modules under vllm/entrypoints/openai
and vllm/entrypoints/pooling): `rerank` has three paths (`/rerank`, Jina's `/v1/rerank`, Cohere's
`/v2/rerank`), `score` two (vLLM moved `/v1/score` to `/score` and keeps both).
"""

from __future__ import annotations

import functools
from typing import Literal

__all__ = ["API_PATHS", "Api", "DEFAULT_APIS", "paths_of"]

Api = Literal[
    "chat/completions",
    "completions",
    "responses",
    "embeddings",
    "rerank",
    "score",
    "pooling",
    "classify",
    "tokenize",
    "detokenize",
]

# Each API's paths, in this order wherever paths are listed (route tables, docs).
API_PATHS: dict[Api, tuple[str, ...]] = {
    "chat/completions": ("/v1/chat/completions",),
    "completions": ("/v1/completions",),
    "responses": ("/v1/responses",),
    "embeddings": ("/v1/embeddings",),
    "rerank": ("/rerank", "/v1/rerank", "/v2/rerank"),
    "score": ("/score", "/v1/score"),
    "pooling": ("/pooling",),
    "classify": ("/classify",),
    "tokenize": ("/tokenize",),
    "detokenize": ("/detokenize",),
}

# What a generative model's pool serves unless it says otherwise.
DEFAULT_APIS: tuple[Api, ...] = ("chat/completions", "completions", "responses")


@functools.cache
def paths_of(apis: tuple[Api, ...]) -> tuple[str, ...]:
    """The paths of `apis`, each once, in API_PATHS's order (whatever order `apis` has);
    cached, as many pools share one list."""
    wanted = set(apis)
    return tuple(path for api, paths in API_PATHS.items() if api in wanted for path in paths)
