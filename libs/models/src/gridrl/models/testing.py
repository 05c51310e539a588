"""Tiny random models for tests: a llama small enough to build in a second.

Used by the tests of every package (adapters, rollout, trainer) so they share one definition.
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(out: Path, seed: int = 0, vocab_size: int = 512, hidden_size: int = 64,
                    num_layers: int = 2, tokenizer_from: Path | None = None,
                    rope_theta: float | None = None) -> Path:
    """Write a random llama (fp32, tied embeddings off) with a word-level tokenizer to ``out``.

    The tokenizer has a chat template and eos ``</s>`` so chat-formatted prompts work.
    With ``tokenizer_from``, that directory's tokenizer is copied instead and the vocabulary
    size follows it. ``rope_theta``: the rope base (transformers' default 10000 when None),
    written as transformers 5 writes it (under ``rope_parameters`` only); the weights do not
    depend on it. Returns ``out``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_from)
        vocab_size = len(tok)
    else:
        tok = _word_tokenizer(vocab_size)
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **({} if rope_theta is None else
           {"rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)}}),
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the default init, so sampling is not uniform
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    return out


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _word_tokenizer(vocab_size: int):
    """A whitespace word-level fast tokenizer: special tokens, then w0..wN, then a few words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    words = ["the", "a", "cat", "dog", "red", "blue", "sky", "sea", "run", "jump", "reverse",
             "words", "order", ":", ".", ","]
    vocab_list = specials + words
    vocab_list += [f"w{i}" for i in range(vocab_size - len(vocab_list))]
    vocab = {w: i for i, w in enumerate(vocab_list)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>")
    tok.chat_template = _CHAT_TEMPLATE
    return tok
