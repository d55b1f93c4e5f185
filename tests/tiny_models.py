"""Tiny random models of every supported family, built in-process from configs.

Like transformers' ``LlamaModelTester``: hidden size 32, 2-3 layers, 4 heads (2 KV heads
where the family has GQA), vocabulary 99. Each config turns on the family's quirk:
biases, q/k norms, soft-capping, sliding windows, Conv1D projections.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

from contribution_weights import LoadedModel

VOCAB = 99


class CharTokenizer:
    """A stand-in tokenizer: one token per character, ids modulo the vocabulary."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(33 + i % 90) for i in ids)


def _common(**extra: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    base.update(extra)
    return base


def config_for(model_type: str) -> Any:
    if model_type == "llama":
        return tf.LlamaConfig(**_common(attention_bias=True))  # o_proj bias too
    if model_type == "mistral":
        return tf.MistralConfig(**_common(sliding_window=5))
    if model_type == "qwen2":
        return tf.Qwen2Config(**_common())
    if model_type == "qwen3":
        return tf.Qwen3Config(**_common(head_dim=8))
    if model_type == "gemma":
        return tf.GemmaConfig(**_common(head_dim=16))
    if model_type == "gemma2":
        return tf.Gemma2Config(
            **_common(head_dim=8, num_hidden_layers=3, sliding_window=4),
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=8,
        )
    if model_type == "gemma3_text":
        return tf.Gemma3TextConfig(
            **_common(head_dim=8, num_hidden_layers=3, sliding_window=4),
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    if model_type == "phi3":
        return tf.Phi3Config(**_common(pad_token_id=0))
    if model_type == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
    if model_type == "gpt_neox":
        return tf.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            rotary_pct=0.5,
        )
    raise ValueError(model_type)


FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt2",
    "gpt_neox",
]


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A random model of the family, in eval mode, wrapped with the char tokenizer."""
    torch.manual_seed(seed)
    config = config_for(model_type)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    # Random init leaves biases at zero; give every bias a value so bias paths are tested.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    return LoadedModel(model=model, tokenizer=CharTokenizer(), name=f"tiny-{model_type}")


def char_tokenizer_fast() -> Any:
    """A real (saveable) Hugging Face tokenizer: one token per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 32 + VOCAB - 1)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def save_tiny(model_type: str, folder: Any, seed: int = 0) -> Any:
    """Save a tiny random model and a char tokenizer as a local model folder."""
    loaded = tiny_model(model_type, seed=seed)
    # keep AutoTokenizer on the saved char tokenizer, not the family's own class
    loaded.model.config.tokenizer_class = "TokenizersBackend"
    loaded.model.save_pretrained(folder)
    char_tokenizer_fast().save_pretrained(folder)
    return folder
