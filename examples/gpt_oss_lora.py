"""GPT-OSS fine-tuning with TRL + PEFT at TP: PEFT's recipe (every linear layer, and the experts' gate_up_proj and
down_proj with their biases) on a tensor-parallel model.

    torchrun --nproc-per-node 2 examples/gpt_oss_lora.py [PATH] [OUT]

PATH: a GPT-OSS checkpoint (openai/gpt-oss-20b downloaded, or any local copy); without it a tiny random GPT-OSS is
made in a temporary folder (nothing is downloaded). Each rank reads its slices; TRL's SFTTrainer takes the model as
it is (the ranks of the TP group get the same batches) and trains the adapters, which are saved in PEFT's format to
OUT (default ``gpt-oss-lora``): plain transformers + PEFT serves them (``PeftModel.from_pretrained``). On GPUs use
bf16 (the SFTConfig default); on CPU this runs in fp32.
"""

import sys
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

import hf_moe_tp


def tiny_gpt_oss(folder: str) -> str:
    """A small random GPT-OSS (2 layers, 4 experts) saved with save_pretrained."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_local_experts=4,
                          num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          vocab_size=256, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    word_tokenizer(config.vocab_size).save_pretrained(folder)  # TRL's trainers want one
    return folder


def word_tokenizer(vocab: int):
    """A tokenizer of the words "t0" ... "t<vocab - 1>", one id each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0", unk_token="t0")


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else None  # "" too: the tiny model
    out = sys.argv[2] if len(sys.argv) > 2 else "gpt-oss-lora"
    with tempfile.TemporaryDirectory() as tmp:
        model = hf_moe_tp.from_pretrained(path or tiny_gpt_oss(tmp))  # TP over every rank
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        rows = torch.randint(0, model.config.vocab_size, (32, 16), generator=torch.Generator().manual_seed(0))
        args = SFTConfig(out, max_steps=4, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-3,
                         save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                         bf16=torch.cuda.is_available())
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}),
                             peft_config=lora)
        trainer.train()
        trainer.model.save_pretrained(out)  # PEFT's files, written once (rank 0), whole tensors
        if trainer.accelerator.is_main_process:
            print(f"adapters saved to {out}")


if __name__ == "__main__":
    main()
