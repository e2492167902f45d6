"""Example 8: Teleport and Syre inside the transformers ``Trainer``, on a peft LoRA model.

A tiny Llama built from a config (nothing is downloaded) gets LoRA adapters from
peft and learns a synthetic next-token task (each sequence follows a fixed random
permutation of the vocabulary).  teleopt needs no Trainer subclass or callback:

1. ``teleopt.integrations.peft.lora_sites(model)`` finds one ``lora_gl`` site per
   adapter pair (GL_r: B -> B g^{-1}, A -> g A leaves B A, hence the model, unchanged);
2. the optimizer handed to ``Trainer(optimizers=(optimizer, None))`` is a teleopt
   wrapper around ``AdamW``.  The Trainer builds its LR scheduler on it and
   accelerate wraps it in an ``AcceleratedOptimizer``; both only call the standard
   ``torch.optim.Optimizer`` API, so the wrapper's ``step`` still runs every step;
3. ``Teleport(..., objective="balance", every=k, search=SearchConfig(trust_region=None))`` moves every
   pair to its balanced point A A^T = B^T B every k steps (the least weight norm on
   the orbit, closed form, no extra forward or backward pass), transports ``.grad`` and Adam's ``exp_avg``
   and checks on a fixed probe batch from ``batch_fn`` (a dict, as the Trainer's
   collator makes it, with ``labels`` so the output's ``.loss`` is the loss) that
   the loss did not change, in train mode with LoRA dropout (same masks); once that
   first teleport passed, later ones take the lean closed-form path, unchecked
   (``docs/performance.md``), and print ``loss drift -``;
4. ``Syre(AdamW(..., weight_decay=0.0), gamma=...)`` replaces AdamW's decay towards
   zero with decay towards a random anchor (Ziyin et al. 2025), the same way.

Run: ``python examples/08_hf_trainer.py [--steps N] [--quick]``.

Needs: the ``hf`` extra (transformers, peft, accelerate): ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

import teleopt
from teleopt.integrations.peft import lora_sites
from teleopt.teleport import SafetyConfig, SearchConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # build everything from configs

VOCAB, LENGTH = 32, 16


def tiny_lora_llama(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama (hidden 32) from a config, with rank-4 LoRA on every projection."""
    import peft
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
    )
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)


def permutation_task(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences x_{t+1} = perm[x_t] from random starts: a next-token task a LoRA fine-tune can learn."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1234))
    rows = []
    for _ in range(n):
        ids = torch.empty(LENGTH, dtype=torch.long)
        ids[0] = torch.randint(0, VOCAB, (1,), generator=g)
        for t in range(1, LENGTH):
            ids[t] = perm[ids[t - 1]]
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def train(optimizer_for, steps: int, output_dir: str, lr: float, seed: int = 0) -> dict[str, Any]:
    """Train a fresh LoRA model with the optimizer ``optimizer_for(model)`` in a transformers Trainer."""
    import transformers

    model = tiny_lora_llama(seed)
    optimizer = optimizer_for(model)
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=lr,  # the scheduler sets the base optimizer's lr from it (warm-up, then linear decay)
        lr_scheduler_type="linear",
        warmup_steps=max(1, steps // 10),
        logging_steps=max(1, steps // 4),
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=seed,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=permutation_task(512, seed), optimizers=(optimizer, None))
    result = trainer.train()
    held_out = {k: torch.stack([r[k] for r in permutation_task(64, seed + 1)]) for k in ("input_ids", "labels")}
    model.eval()
    with torch.no_grad():
        eval_loss = float(model(**held_out).loss)
    return {"trainer": trainer, "optimizer": optimizer, "model": model, "train_loss": result.training_loss, "eval_loss": eval_loss}


def lora_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="balance teleport every k steps")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0, help="the initial weights and the data (the same for every arm)")
    parser.add_argument("--quick", action="store_true", help="8 steps, teleport every 3 (what the test suite runs)")
    args = parser.parse_args(argv)
    steps, every = (8, 3) if args.quick else (args.steps, args.every)
    probe = {k: torch.stack([r[k] for r in permutation_task(16, seed=7)]) for k in ("input_ids", "labels")}

    def adamw(model):
        return torch.optim.AdamW(lora_params(model), lr=args.lr, weight_decay=0.0)

    def balance(model):  # (1) + (3)
        return teleopt.Teleport(
            adamw(model),
            model,
            lora_sites(model).sites,
            objective="balance",  # least weight norm on the orbit: A A^T = B^T B
            every=every,
            safety=SafetyConfig(max_predicted_decrease=None),
            batch_fn=lambda: (probe, None),  # checks the loss on this batch; model(**probe).loss
            search=SearchConfig(trust_region=None),
        )

    def syre(model):  # (4)
        return teleopt.Syre(adamw(model), gamma=0.01, decoupled=True)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        arms = [("AdamW (baseline)", adamw), ("Teleport(AdamW) balance", balance), ("Syre(AdamW)", syre)]
        for name, make in arms:
            results[name] = train(make, steps, os.path.join(tmp, name.split("(")[0].strip()), args.lr, args.seed)
    print(f"{'optimizer':<26} {'train loss':>10} {'held-out loss':>14}")
    for name, r in results.items():
        print(f"{name:<26} {r['train_loss']:>10.4f} {r['eval_loss']:>14.4f}")

    teleport = results["Teleport(AdamW) balance"]["optimizer"]
    trainer = results["Teleport(AdamW) balance"]["trainer"]
    print(f"Trainer.optimizer is a {type(trainer.optimizer).__name__} around {type(teleport).__name__}({type(teleport.base).__name__})")
    print(teleport.summary())
    for report in teleport.reports:
        drift = "-" if report.loss_drift is None else f"{report.loss_drift:.1e}"
        print(f"step {report.step}: {report.reason}, {len(report.sites)} LoRA sites, loss drift {drift}, {report.state_decisions}")
    print(f"Syre penalty (gamma/2)|w - anchor|^2 at the end: {results['Syre(AdamW)']['optimizer'].penalty().item():.3e}")
    return {
        "results": results,
        "teleport": teleport,
        "trainer": trainer,
        "syre": results["Syre(AdamW)"]["optimizer"],
        "every": every,
    }


if __name__ == "__main__":
    main()
