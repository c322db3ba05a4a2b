"""A tiny random Qwen3 model and BPE tokenizer, built locally and cached (nothing is downloaded).

For the demo and the integration tests on CPU. The weights are random but deterministic, and large
enough at initialisation that greedy decoding changes token from step to step: a model that repeats
one token would hide KV corruption.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SPEC = {
    "layers": 4, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "head_dim": 64,
    "max_positions": 4096, "vocab": 1024, "initializer_range": 0.35, "seed": 1234,
}
#: The bench's seed preset: KV-heavy for its compute. Qwen3-32B's 64 layers, each a region of its
#: own to move, with one KV head of 64 (a block of 32 tokens per layer is 8 KiB in float32, as a
#: TP-8 rank's one head of 128 is in bf16), over a thin residual stream: a 2,048-token prompt
#: prefills in well under a second on one core here, and its KV is thousands of (block, layer) pieces.
KV_HEAVY = {**SPEC, "layers": 64, "hidden": 64, "intermediate": 128, "heads": 1, "kv_heads": 1,
            "head_dim": 64, "max_positions": 8192}
_WORDS = (
    "prefill decode cache block tensor trainium neuron fabric write read lease fence token router "
    "request latency throughput memory register notify heartbeat cancel expire rank layer head value "
    "key attention model server client stream answer question river mountain ocean forest city "
    "music garden window morning evening silver copper orange purple yellow green blue red seven "
    "eleven thirty hundred thousand quick lazy brown fox jumps over the a an and of to in on at by"
).split()


def cache_dir(spec: dict = SPEC) -> Path:
    root = Path(os.environ.get("NEURON_DISAGG_CACHE", Path.home() / ".cache" / "neuron-disagg"))
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"tiny-qwen3-{digest}"


def _corpus(lines: int = 2000) -> list[str]:
    import random

    rng = random.Random(SPEC["seed"])  # one tokenizer for every spec
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def build(path: Path | None = None, spec: dict = SPEC) -> Path:
    """Build (once) and return the directory holding the model and tokenizer."""
    path = path or cache_dir(spec)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # its bar goes to stdout, where callers read the path
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(tmp)
    torch.manual_seed(spec["seed"])
    config = Qwen3Config(
        vocab_size=len(fast), hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_positions"], initializer_range=spec["initializer_range"],
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path) if not path.exists() else None
    return path


if __name__ == "__main__":
    print(build())
