"""Rampwatch in the Hugging Face Trainer (rampwatch.integrations.transformers), runnable: a tiny
GPT-2 built from a config on fixed random tokens, nothing downloaded
(tests/test_integration_transformers.py runs it). An approved ramp (or `auto`) saves a
checkpoint and exits with status 75: the same command continues the same run at the new tier, so
a shell loop keeps it going:

    python examples/hf_trainer.py runs.duckdb [auto]
    until python examples/hf_trainer.py runs.duckdb; [ $? -ne 75 ]; do :; done

Every start must see the same data in the same order (here: seeded), as for any Trainer resume.
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from rampwatch.integrations.transformers import RampwatchTrainer, resume_args

torch.manual_seed(0)
model = GPT2LMHeadModel(
    GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
)
tokens = torch.randint(0, 64, (2048, 16))
data = [{"input_ids": t, "labels": t} for t in tokens]  # any map-style dataset

# --- the integration ----------------------------------------------------------------------
db = sys.argv[1]
args = TrainingArguments(
    **resume_args(
        db + ".checkpoints", per_device_train_batch_size=4, gradient_accumulation_steps=2
    ),
    max_steps=40,
    learning_rate=1e-3,
    eval_strategy="steps",  # eval_loss is drawn on the loss chart, as val_loss
    eval_steps=20,
    report_to=[],
    save_strategy="no",
)
trainer = RampwatchTrainer(
    model=model,
    args=args,
    train_dataset=data,
    eval_dataset=data[:64],
    db=db,
    name="hf-trainer",
    ramp=sys.argv[2] if len(sys.argv) > 2 else "manual",
)
trainer.train()  # an applied ramp saves checkpoint-N and exits 75 here; the run continues above
