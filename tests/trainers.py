"""What the Trainer tests share (a helper, not a test module): token rows, the Trainer's arguments, a tokenizer
for the tiny models, and a fresh accelerate state between Trainers in one process."""

from __future__ import annotations

import torch
from transformers import TrainingArguments

PER_DEVICE = 2


class Rows(torch.utils.data.Dataset):
    """``n`` random token rows, each its own labels."""

    def __init__(self, n: int, vocab: int = 128, seed: int = 0) -> None:
        self.ids = torch.randint(0, vocab, (n, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: str, batch: int = PER_DEVICE, **overrides) -> TrainingArguments:
    settings = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                    max_steps=3, logging_steps=1, save_strategy="no", report_to=[], learning_rate=1e-2, seed=0,
                    disable_tqdm=True)
    return TrainingArguments(**{**settings, **overrides})


def fresh_accelerate() -> None:
    """A Trainer makes accelerate's process-wide state; the pool's ranks run one Trainer after another."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def word_tokenizer(vocab: int = 128):
    """A tokenizer for the tiny models' ids ("t0" ... "t127"), made here: TRL's trainers want one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0", unk_token="t0")
