"""Benchmarks that ship with memfit, so ``memfit bench`` runs them from an installed package.

``runner``       one protocol for every benchmark of a training step: first step, exact peak,
                 interleaved timing, failures recorded (also measures ``memfit demo``/``profile``);
``peers``        the ways PyTorch alone trains a model (``checkpoint_sequential``, entry points
                 for ``torch.compile``), set beside memfit;
``depth_sweep``  peak memory and step time against depth, against ``checkpoint_sequential``;
``resnet``       the CIFAR ResNet shared by the demo, the benchmarks and the zoo;
``zoo``          the small models every feature is tested on, also trained by the benchmark
                 scripts in ``benchmarks/``; ``graphs`` captures their joint graphs unchanged;
``hf_tiny``      every HuggingFace architecture transformers ships, as a tiny random model with
                 its task's loss and a batch with labels (configs only, no download);
``hf_sweep``     one architecture trained plain, with HF's checkpointing and memfit ``"memory"``
                 and ``"none"``, checked and measured in its own process (the sweep's row);
``environment``  machine, software and load, recorded beside every result;
``failure``      how one failed point is recorded without ending a sweep.

Nothing here writes a file it was not told to: commands pass ``--out``, the repository's scripts
pass ``benchmarks/results``.
"""
