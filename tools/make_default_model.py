"""(Re)create the tiny default model that `omnirun generate` runs when no --model is given.

Everything is made offline and deterministically: a byte-level BPE tokenizer trained on the small corpus below,
and a 4-layer Llama with random weights (our own seeded draws). Its text is nonsense; it exists so a fresh install
can run end to end without downloading anything.

    python tools/make_default_model.py            # writes common/assets/default_model/
    python tools/make_default_model.py --out DIR  # writes DIR instead (used by the determinism test)
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "common" / "assets" / "default_model"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]
MAX_DIR_BYTES = 1_500_000
# Written for this project; nothing here is copied from elsewhere.
CORPUS = """\
A model runner loads the weights of a language model onto one device and runs its forward passes. Each step it
takes a batch of requests, looks up the keys and values it stored for earlier tokens, computes attention for the
new tokens, and turns the last hidden state of every request into logits over the vocabulary.

Serving a large language model is mostly a question of memory. The weights must fit, and what is left over holds
the key-value cache. The cache is cut into pages of a fixed number of tokens, so that a request can grow one page
at a time and a finished request gives its pages back without moving anybody else's data.

Devices differ in many small ways. One accelerator has fast matrix units for bfloat16, another prefers float16,
a third can store the cache in eight-bit floating point. One offers graph capture, which records a whole decode
step once and replays it with almost no launch overhead; another runs every kernel eagerly. A good runner asks the
platform what it can do instead of asking which device it is on.

Kernels are the small programs that do the real work: matrix multiplication, attention, normalisation, rotary
position embeddings and the gated activation of the feed-forward block. A portable kernel written once can run on
several vendors' hardware, while a hand-tuned kernel is faster on the one device it was written for. The runner
keeps a plain reference for every operation and lets each platform replace it with something faster.

Sampling picks the next token from the logits. Greedy decoding takes the most likely token. Temperature flattens
or sharpens the distribution; top-k keeps the k most likely tokens; top-p keeps the smallest set whose probability
adds up to p; min-p drops tokens far less likely than the best one. A seed per request makes the choice repeatable.

The scheduler decides which requests run in each step. New prompts are prefilled in large chunks, while running
requests decode one token each. When memory runs short, the scheduler waits, or it evicts the pages of a request
and computes them again later. Throughput, latency and fairness pull in different directions, and the numbers on a
benchmark depend on all three.

Hello, world! This is a tiny model with random weights. It speaks nonsense, quickly, on any device: CPU, GPU or
something newer. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32, 64, 128, 256, 512 and 1024 appear in logs.
"""


# A small ChatML-like chat template (what `omnirun serve` applies to /v1/chat/completions messages): each turn is
# <s>role, a newline, the content and </s> (EOS, so a reply ends at the end of its turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on CORPUS and wrap it for transformers."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # No prefix space: decode(encode(s)) must give back s exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes are in the vocabulary, so any text encodes without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1024,
        # Cleaning up spaces before punctuation would break the exact round trip.
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A 4-layer Llama sized for the tokenizer, with seeded random weights, cast to bfloat16."""
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.convert_tokens_to_ids("<s>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("</s>"),
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Our own seeded draws, one generator per tensor in name order, not transformers' init: the shipped weights then
    # do not change when a transformers release changes how it initialises (the test regenerates them). Norm
    # weights scatter around one, so a wrong norm shows.
    with torch.no_grad():
        for index, (name, param) in enumerate(sorted(model.named_parameters())):
            draw = torch.Generator().manual_seed(index)
            noise = torch.randn(param.shape, generator=draw, dtype=torch.float32)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
    # ~656k parameters: float32 would be ~2.6 MB, bfloat16 keeps the shipped directory near 1.3 MB.
    return model.to(torch.bfloat16)


def write_readme(out: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """A few lines saying what the directory is and how it was made."""
    (out / "README.md").write_text(
        "# omnirun default model\n\n"
        "The tiny model `omnirun generate` runs when no `--model` is given, so a fresh install works offline.\n\n"
        f"- Llama architecture: 4 layers, hidden size 128, 4 attention heads (2 KV heads), "
        f"vocabulary {len(tokenizer)}, "
        "tied embeddings, bfloat16 weights.\n"
        "- The weights are random (seeded normal draws, one generator per tensor): the text it generates is nonsense.\n"
        "- The tokenizer is a byte-level BPE trained on a few paragraphs written for this project.\n"
        "- `chat_template.jinja` is a small ChatML-like chat template (`<s>role\\ncontent</s>` per turn).\n\n"
        "Made by `python tools/make_default_model.py` (deterministic: running it again gives the same files).\n"
    )


def make_default_model(out: Path) -> Path:
    """Build the tokenizer and model in a scratch directory, then replace `out` with it."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch) / "model"
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        write_readme(tmp, tokenizer)
        for path in tmp.iterdir():
            path.chmod(0o644)  # the safetensors writer leaves 0600; installed files must be readable by everyone
        size = sum(p.stat().st_size for p in tmp.iterdir())
        if size > MAX_DIR_BYTES:
            raise SystemExit(f"default model is {size} bytes, over the {MAX_DIR_BYTES} budget: shrink the config")
        # Only a directory this script made (or an empty one) is replaced, so a wrong --out cannot wipe real data.
        if out.exists() and any(out.iterdir()) and not (out / "README.md").is_file():
            raise SystemExit(f"--out {out} is a non-empty directory not made by this script: pick an empty one")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory to write (default: {DEFAULT_OUT})")
    out = make_default_model(parser.parse_args().out)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size} bytes): {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
