"""vLLM's own block hasher over prompt lengths read on stdin: the reference of `kvshm bench hash`.

`kvshm bench hash` runs this (compiled into the binary) with a Python that has vLLM installed
($KVSHM_VLLM_VENV/bin/python, or --vllm-python), sending one prompt length per line. For each
prompt it builds a vLLM `Request` of that many tokens (the same pseudo-random ids as kvshm's side
uses, below 2^17) without a hasher, then times vLLM's request block hasher on it: every full
block hashed with vLLM's default prefix-caching hash, `sha256` (the block's parent hash, token
ids and extra keys pickled, then SHA-256). A second pass gives the request a LoRA adapter, which
adds one extra key per block. It prints one JSON object: GB/s of token bytes (4 per token, as
kvshm counts them) and microseconds per request.
"""

import argparse
import json
import math
import sys
import time


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {"p50": 0.0, "p99": 0.0}

    def rank(p: float) -> float:
        return ordered[min(len(ordered), max(1, math.ceil(p * len(ordered)))) - 1]

    return {"p50": rank(0.50), "p99": rank(0.99)}


def tokens_like_kvshm(count: int) -> list[int]:
    """The token ids of kvshm's side: xorshift64* from the same seed, top 17 bits."""
    state, mask, tokens = 0x7E57AB1E00000001, (1 << 64) - 1, []
    for _ in range(count):
        state ^= state >> 12
        state ^= (state << 25) & mask
        state ^= state >> 27
        tokens.append(((state * 0x2545F4914F6CDD1D) & mask) >> 47)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-tokens", type=int, default=512)
    args = parser.parse_args()
    prompts = [int(line) for line in sys.stdin.read().split()]

    import vllm
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    algorithm = "sha256"
    hash_fn = get_hash_fn_by_name(algorithm)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(args.block_tokens, hash_fn)
    tokens = tokens_like_kvshm(max(prompts, default=0))
    params = SamplingParams(max_tokens=1)
    lora = LoRARequest(lora_name="bench-adapter", lora_int_id=1, lora_path="/nonexistent")
    full_blocks = sum(prompt // args.block_tokens for prompt in prompts)
    token_bytes = full_blocks * args.block_tokens * 4

    def run(lora_request: LoRARequest | None) -> dict[str, object]:
        times = []
        for index, prompt in enumerate(prompts):
            request = Request(str(index), tokens[:prompt], params, None, lora_request=lora_request)
            start = time.perf_counter()
            hashes = hasher(request)
            times.append(time.perf_counter() - start)
            assert len(hashes) == prompt // args.block_tokens
        return {
            "gb_per_s": token_bytes / sum(times) / 1e9 if times else 0.0,
            "us_per_request": percentiles([t * 1e6 for t in times]),
        }

    plain = run(None)
    result = {
        "vllm_version": vllm.__version__,
        "hash_algorithm": algorithm,
        **plain,
        "extra_keys": run(lora),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
