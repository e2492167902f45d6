"""teleopt's realistic benchmark suite: tuned baselines against Teleport and Syre arms on the training people run.

Run from the repository root::

    python -m benchmarks.realistic                       # all 5 configurations, 5 seeds, every arm
    python -m benchmarks.realistic --quick --json /tmp/r.json   # CI smoke run (1 seed, minimum steps)
    python -m benchmarks.realistic --configs mlp_sgd mlp_adamw --arms teleport_once syre_sigma1 --seeds 3
    python benchmarks/realistic/run.py --help             # the same entry point as a script

Configurations (``configs.CONFIGS``; digits = scikit-learn's bundled digits, 1097 train /
250 validation / 450 test, split fixed; the seed draws initialisation and batch order):

* ``mlp_sgd``: MLP 64-256-256-10 ReLU, SGD momentum 0.9, batch 64, 2000 steps (~117 epochs),
  lr grid 0.01/0.03/0.1/0.3, weight decay 5e-4;
* ``mlp_adamw``: the same MLP, AdamW, lr grid 3e-4/1e-3/3e-3, weight decay 0.05;
* ``cnn_adamw``: timm resnet18 at quarter width (``channels=(16,32,64,128)``) on digits
  upsampled to 32x32, AdamW, 20 warm-up steps then cosine, 300 steps, lr grid 1e-3/3e-3/1e-2;
* ``vit_adamw``: timm vit_tiny narrowed (``img_size=16, patch_size=4, depth=6, embed_dim=96,
  num_heads=3``) on 16x16 digits, AdamW, warm-up 20 + cosine, 300 steps, lr grid 3e-4/1e-3/3e-3;
* ``lora_adamw``: a hand-written 2-layer transformer (d 48, 4 heads, ReLU MLP 96) pre-trained
  600 steps on a synthetic teacher task A (token + bigram counts, 8 classes, 16 tokens of 16),
  then LoRA rank 4 (``lora_a``/``lora_b`` on q, v, fc1, fc2, detected as ``gl_linear`` sites) plus
  the head fine-tuned on task B (the teacher changed by a rank-2 update), 1000/250/1000
  sequences, AdamW, warm-up 20 + cosine, 400 steps, lr grid 1e-3/3e-3/1e-2;
* ``llama_lm`` (``lm.py``): ``transformers.LlamaForCausalLM`` built from a config (RMSNorm,
  rotary, SwiGLU, grouped-query attention; hidden 64, 4 layers, 4 heads, 2 KV heads: 0.21M
  parameters; ``--large``: hidden 256, 8 layers, 5.9M parameters), byte-level, trained from scratch on the English text of Python's documentation
  topics (``pydoc_data``), context 64, batch 32, AdamW (0.9, 0.95), warm-up 100 + cosine, 1500
  steps; lr 1e-3/3e-3/1e-2 x weight decay 0/0.1/0.3 tuned together;
* ``llama_lora``: that model pre-trained 1500 steps on English (per seed, not timed), then
  peft LoRA r=8 on every projection fine-tuned on Python standard-library source, 600 steps;
  plain LoRA and ``balora`` (every pair projected onto the balanced set after each step) are
  baselines tuned each on its own lr x decay grid.

The language models' default sizes train on a CPU core; ``--large`` is meant for a GPU
(``--device cuda``); their ``--quick`` form (hidden 64, 2 layers) is the CI smoke run.  On them the next-byte accuracy stands for the test accuracy, the
"never worse" bound on the best validation loss is 1.01x, and the decay arms add Cautious
Weight Decay (``cautious_wd``) to plain decay and Syre.

Each baseline's lr is the grid point with the lowest best validation loss on seed 1000
(no measured run uses it); while the best point is at an edge the grid is extended by its own
ratio (at most twice).  Scores are cached in ``tuned_lr.json`` (``--retune`` to redo, ``--tuned
PATH`` for another cache; only unscored points are run).  Every arm of one seed starts from the
same initialisation and sees the same batches (teleport batches come from their own generator);
the arm order is rotated per seed.  Arms (``arms.ARMS``, one line each): ``baseline``,
``teleport_default`` (exactly ``Teleport(opt, model, "auto", example_inputs=..., loss_fn=...,
batch_fn=...)``), ``teleport_once`` (``at=[20]``, after warm-up), ``teleport_every200``,
``weight_decay`` (plain decay at the configuration's comparison strength), ``syre_default`` and
``syre_sigma1`` (Syre at the same strength, ``exclude_1d``, decoupled for AdamW).

Measured per run: full train / validation loss every ``eval_every`` steps (evaluation not timed),
test loss and accuracy at the end and at the best-validation checkpoint, dead units and feature
rank of the last hidden representation, teleports accepted / declined / rolled back and their
seconds and cost in iterations.  Times: ``s`` = the baseline's median
iteration time of the same seed x (steps x the arm's step overhead + the teleports' cost in the
run's own iterations); the step overhead is the median over seeds of the arm's iteration time over
the baseline's.  On the shared 2-core machine the raw measured seconds of identical runs differed
by 0.39-1.54x, and whole runs' iteration times by 2x, so the verdict uses this load-robust time;
the raw measured speed-ups are kept (``measured_speedup_*``).  A run diverges when its train loss is
non-finite or ends > 10x its best and > 0.5x its start.

Budget, one core of a quiet machine (per run, evaluation included): MLP ~2-4 s, CNN ~30-50 s,
ViT ~30-50 s (a general-path teleport ~4 s), LoRA ~5-10 s; the full run (5 configurations x 7
arms x 5 seeds + lr grids, ~190 runs) is about 50-60 minutes; under load on the shared machine
several times that.  ``--configs`` / ``--seeds`` cut it down, and configurations can run in
parallel processes and be combined with ``--merge a.json b.json --json all.json``.  ``--quick``
(1 seed, 6-40 steps, 200-sample evaluation sets) is ~30 s of CPU.  ``--device cuda --large``
scales the models up for a GPU; nothing needs one.

Verdicts (``core.verdicts``, printed under each table and in the JSON): default Teleport never
worse than the tuned baseline (median test accuracy >= baseline - 0.5 points, median best
validation loss <= 1.05x, no divergence); a teleopt arm wins (median per-seed speed-up >= 1.3x to
the baseline's best validation loss, or best validation loss / test accuracy beyond the seed
spread); Syre's defaults against plain decay on collapse configurations (fewer dead units, higher
feature rank, test accuracy within 0.5 points or better).  Overall: wins needed on 3 of 5.
"""
