"""Warm the simulated pods' tokenizer once, before the first strategy.

vllm-sim tokenizes every prompt with the HuggingFace tokenizer, whose BPE word
cache lives as long as the process and survives `POST /admin/flush`. Without
this step the first strategy of a run pays the cold cache alone: on a short
full-size smoke run (840 requests) the simulator burned 14–15 CPU-s instead of
3–4, on a 2-core machine shared with the client and the router, and the first
strategy's TTFT p90 was ~9 s instead of 1.3–1.9 s, whichever router it was. So every prompt of the
workload is sent once to `POST /tokenize` (the tokenizer is shared by every pod
of the process), and all strategies start from the same warm tokenizer.

The prompts are inference-perf's own: its shared_prefix generator (or, for
multi-turn data, its conversation_replay generator: each conversation's system
prompt and user messages) is built from the run's inference-perf config, with
the same seed and tokenizer.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List


def workload_prompts(config_path: str) -> List[str]:
    from inference_perf.config import read_config
    from inference_perf.utils.custom_tokenizer import CustomTokenizer

    cfg = read_config(config_path)
    if cfg.data.conversation_replay is not None:
        # Multi-turn: a conversation's text without its answers (the pods' own, 16 fixed words).
        from inference_perf.datagen.replay.conversation_replay_datagen import ConversationReplayDataGenerator

        conv = ConversationReplayDataGenerator(cfg.api, cfg.data, CustomTokenizer(cfg.tokenizer))
        return [" ".join([bp.system_prompt, *bp.turn_prompts]) for bp in conv.blueprints]
    from inference_perf.datagen.synthetic.shared_prefix_datagen import SharedPrefixDataGenerator

    gen = SharedPrefixDataGenerator(cfg.api, cfg.data, CustomTokenizer(cfg.tokenizer))
    return list(gen.prompts)


def _tokenize(address: str, model: str, prompt: str) -> bool:
    body = json.dumps({"model": model, "prompt": prompt}).encode()
    req = urllib.request.Request(f"http://{address}/tokenize", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status == 200


def prime(address: str, model: str, config_path: str) -> Dict[str, Any]:
    """Tokenize every prompt of the workload once on `address`; returns what was done."""
    t0 = time.time()
    prompts = workload_prompts(config_path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        ok = sum(pool.map(lambda p: _tokenize(address, model, p), prompts))
    return {"prompts": len(prompts), "tokenized": ok, "seconds": round(time.time() - t0, 1)}
