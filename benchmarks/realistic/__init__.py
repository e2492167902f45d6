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
  sequences, AdamW, warm-up 20 + cosine, 400 steps, lr grid 1e-3/3e-3/1e-2.

Each baseline's lr is the grid point with the lowest best validation loss on seed 1000
(no measured run uses it), cached in ``tuned_lr.json`` (``--retune`` to redo, ``--tuned PATH``
for another cache).  Every arm of one seed starts from the same initialisation and sees the
same batches; the arm order is rotated per seed.  Arms (``arms.ARMS``, one line each):
``baseline``, ``teleport_default`` (exactly ``Teleport(opt, model, "auto", example_inputs=...,
loss_fn=..., batch_fn=...)``), ``teleport_once`` (``at=[20]``, after warm-up),
``teleport_every200``, ``weight_decay`` (plain decay at the configuration's comparison strength),
``syre_default`` and ``syre_sigma1`` (Syre at the same strength, ``exclude_1d``).

Budget: the full 5-configuration run (5 seeds x 7 arms + lr grids) is about 40-60 minutes on one
core of a quiet machine: MLP runs ~3-5 s each, CNN ~20 s, ViT ~30 s, LoRA ~10 s.  ``--quick``
(1 seed, 6-40 steps, 200-sample evaluation sets) takes well under a minute.  ``--device cuda
--large`` scales the models up for a GPU; nothing needs one.
"""
