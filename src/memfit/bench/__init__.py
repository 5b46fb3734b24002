"""Benchmarks that ship with memfit, so ``memfit bench`` runs them from an installed package.

``resnet``       the CIFAR ResNet shared by the demo, the benchmarks and the test zoo;
``depth_sweep``  peak memory and step time against depth, against ``checkpoint_sequential``.
"""
